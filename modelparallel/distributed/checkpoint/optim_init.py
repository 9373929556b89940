"""``init_optim_state``: give an optimizer that has not stepped the state tensors a checkpoint loads
into, without changing the training that follows.

A DCP load fills the tensors of the state dict it is given, so an optimizer must have its state
(AdamW's step, moments) before ``optimizer.state_dict()`` is loaded into. SageMaker documents
``init_optim_state`` as "setting zero grads and step". Stepping the live optimizer changes
training: AdamW's step count advances, weight decay moves the weights, and in half precision a
zero-gradient update can turn weights into NaN. So here each parameter without state gets the
state one step of the same optimizer class with the same hyperparameters creates, taken on a
zero-gradient *copy* of the parameter (the parameter, its gradient and the optimizer's hooks are
not touched). These tensors are placeholders: if no load writes into them before the next
``optimizer.step()``, that step starts from an empty state again, exactly as if
``init_optim_state`` had never been called.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict

import torch

_PLACEHOLDERS = "_mp_init_optim_state_placeholders"


def _state_of_one_step(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> dict:
    """The state ``optimizer``'s class creates for ``p`` in one zero-gradient step of ``group``'s
    hyperparameters, computed on a copy of ``p``."""
    twin = torch.nn.Parameter(p.detach().clone(), requires_grad=True)
    twin.grad = torch.zeros_like(twin)
    scratch = copy.copy(optimizer)  # the same class and defaults, none of the live state or hooks
    scratch.state = defaultdict(dict)
    scratch.param_groups = [{**group, "params": [twin]}]
    scratch._optimizer_step_pre_hooks = OrderedDict()
    scratch._optimizer_step_post_hooks = OrderedDict()
    with torch.no_grad():
        type(optimizer).step(scratch)
    return scratch.state[twin]


def _versions(state: dict) -> dict:
    return {k: v._version for k, v in state.items() if isinstance(v, torch.Tensor)}


def _clear_unloaded(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before the next step: drop placeholders no load wrote into (and this hook)."""
    record = optimizer.__dict__.pop(_PLACEHOLDERS, None)
    if record is None:
        return
    for p, (state, versions) in record["states"].items():
        if optimizer.state.get(p) is state and _versions(state) == versions:
            del optimizer.state[p]
    record["handle"].remove()


def init_optim_state(optimizer: torch.optim.Optimizer, skip_empty_param: bool = False) -> None:
    """Create the state of every parameter of ``optimizer`` that requires a gradient and has none,
    as placeholders for a checkpoint load (see the module docstring).

    Args:
        optimizer: a ``torch.optim`` optimizer (AdamW, SGD with momentum...).
        skip_empty_param: leave parameters with no elements stateless, as training leaves the
            parameters FSDP1 holds no shard of on this rank.
    """
    record = optimizer.__dict__.get(_PLACEHOLDERS)
    if record is None:
        handle = optimizer.register_step_pre_hook(_clear_unloaded)
        record = optimizer.__dict__[_PLACEHOLDERS] = {"states": {}, "handle": handle}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p) or (skip_empty_param and p.numel() == 0):
                continue
            state = _state_of_one_step(optimizer, group, p)
            optimizer.state[p] = state
            record["states"][p] = (state, _versions(state))
