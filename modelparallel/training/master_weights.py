"""fp32 master weights for half-precision parameters (mixed-precision training).

With fp16 or bf16 parameters, the optimizer must not update them directly: an update smaller
than half the spacing of neighbouring half-precision numbers (about 1e-3 relative in bf16, 5e-4
in fp16) rounds away, and Adam's default ``eps`` (1e-8) is 0 in fp16. So each half parameter
gets an fp32 copy, the *master*, with the same DTensor placements (its shard has the parameter's
shard's shape, on the same ranks). Each step copies the model's gradients into the masters'
``.grad`` in fp32, divided by the loss scale, steps the wrapped torch optimizer on the masters,
and copies the masters back into the model's parameters (one rounding per step, at the end).
This is the scheme of Micikevicius et al. 2018, "Mixed Precision Training".

At rest the optimizer's ``param_groups`` and ``state`` stay keyed by the model's parameters, as
for any torch optimizer (so code that maps optimizer parameters to model names by identity, such
as checkpointing, needs nothing special), but the state tensors are fp32: the masters are put in
the parameters' place only for the duration of a step or a state-dict load
(``masters_in_optimizer``), which is when torch creates or casts state.

Tied parameters appear once in the optimizer, so they get one master.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..tp.layout import from_local_like, local_part

HALF = (torch.float16, torch.bfloat16)

_OWN_ATTRS = {"param_groups", "state", "defaults"}


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose state cannot move to fp32 masters.

    Masters work by replacing the parameters in ``param_groups``; an optimizer that keeps its
    own references to the parameters elsewhere (``LBFGS._params``, ``ZeroRedundancyOptimizer``)
    would go on updating the half-precision tensors, and one that needs sparse gradients
    (``SparseAdam``) cannot take the dense fp32 copies.

    Raises:
        ValueError: naming the optimizer class and the attribute at fault.
    """
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError(f"{name} needs sparse gradients; fp32 master weights take dense copies. "
                         "Use Adam/AdamW, or train in fp32")
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for attr, value in vars(optimizer).items():
        if attr in _OWN_ATTRS or attr.startswith("_optimizer_") or attr.endswith("_hooks"):
            continue
        if _holds_param(value, params):
            raise ValueError(
                f"{name} cannot keep its state in fp32 master form: it holds its own references to "
                f"the parameters (attribute {attr!r}) besides param_groups, so it would keep "
                "updating the half-precision tensors. Use an optimizer such as AdamW or SGD, or "
                "train in fp32")


def _holds_param(value: Any, params: set[int]) -> bool:
    if isinstance(value, torch.Tensor):
        return id(value) in params
    if isinstance(value, (list, tuple)):
        return any(_holds_param(v, params) for v in value)
    if isinstance(value, dict):
        return any(_holds_param(v, params) for v in value.values())
    return False


def _fp32_copy(p: torch.Tensor) -> nn.Parameter:
    """An fp32 copy of ``p`` with its placements (no communication: the shard is converted)."""
    with torch.no_grad():
        if isinstance(p, DTensor):
            shard = p.to_local().to(torch.float32, copy=True)
            t = from_local_like(shard, p)
        else:
            t = p.detach().to(torch.float32, copy=True)
    return nn.Parameter(t, requires_grad=p.requires_grad)


class MasterWeights:
    """The fp32 masters of an optimizer's half-precision parameters.

    ``model_param(master)`` and ``master_of(param)`` translate between the two.

    Args:
        optimizer: a torch optimizer over a DistributedModel's parameters, not yet stepped or
            stepped with state that is then cast to fp32.

    Raises:
        ValueError: if the optimizer cannot keep fp32 masters (``check_supported``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        check_supported(optimizer)
        self.optimizer = optimizer
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (model param, master)
        self._by_param: dict[int, nn.Parameter] = {}
        self._by_master: dict[int, nn.Parameter] = {}
        self.recreated = False  # masters were recreated from half-precision weights (logged once)
        for group in optimizer.param_groups:
            self.adopt_group(group)

    def adopt_group(self, group: dict[str, Any]) -> None:
        """Give the half-precision parameters of a (newly added) group their masters."""
        for p in group["params"]:
            if p.dtype not in HALF or id(p) in self._by_param:
                continue
            master = _fp32_copy(p)
            state = self.optimizer.state.get(p)
            if state:  # stepped before wrapping: keep the state, now in fp32
                self.optimizer.state[p] = {k: v.float() if torch.is_tensor(v) and v.is_floating_point()
                                           and v.dim() else v for k, v in state.items()}
            self.pairs.append((p, master))
            self._by_param[id(p)] = master
            self._by_master[id(master)] = p

    def __len__(self) -> int:
        return len(self.pairs)

    def master_of(self, p: torch.Tensor) -> nn.Parameter | None:
        return self._by_param.get(id(p))

    def model_param(self, t: torch.Tensor) -> torch.Tensor:
        """The model parameter behind an optimizer parameter (itself if it has no master)."""
        return self._by_master.get(id(t), t)

    def params_and_masters(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(model param, what the optimizer steps: its master or itself), in optimizer order."""
        for group in self.optimizer.param_groups:
            for t in group["params"]:
                p = self.model_param(t)
                yield p, self._by_param.get(id(p), p)

    @torch.no_grad()
    def grads_to_masters(self, scale: float) -> None:
        """Set each master's ``.grad`` to its parameter's gradient in fp32 divided by ``scale``;
        parameters without a master have their gradient divided in place."""
        inv = 1.0 / scale
        for p, t in self.params_and_masters():
            g = p.grad
            if g is None:
                if t is not p:
                    t.grad = None
                continue
            if t is p:
                if scale != 1.0:
                    local_part(g).mul_(inv)
                continue
            g32 = local_part(g).to(torch.float32)
            if scale != 1.0:
                g32.mul_(inv)
            t.grad = from_local_like(g32, t) if isinstance(t, DTensor) else g32

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Round the updated masters into the model's half-precision parameters."""
        for p, master in self.pairs:
            local_part(p).copy_(local_part(master))

    @torch.no_grad()
    def params_to_masters(self) -> None:
        """Recreate the masters from the model's parameters (after loading weights only)."""
        for p, master in self.pairs:
            local_part(master).copy_(local_part(p))

    def clear_master_grads(self) -> None:
        for _, master in self.pairs:
            master.grad = None

    @contextlib.contextmanager
    def masters_in_optimizer(self):
        """Put the masters in their parameters' place in ``param_groups`` and ``state`` for the
        duration (a step, a state-dict load: torch then creates and casts state in fp32)."""
        if not self.pairs:
            yield self.optimizer
            return
        self._swap(lambda t: self._by_param.get(id(t), t))
        try:
            yield self.optimizer
        finally:
            self._swap(self.model_param)

    def _swap(self, to) -> None:
        opt = self.optimizer
        state = {to(t): s for t, s in opt.state.items()}
        for group in opt.param_groups:
            group["params"] = [to(t) for t in group["params"]]
        opt.state.clear()
        opt.state.update(state)
