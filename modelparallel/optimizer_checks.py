"""What wrapping a torch optimizer refuses before anything is registered: parameters that belong
to no ``DistributedModel`` (an optimizer built before wrapping), and ``fused=True`` where DTensor
has no rule for the fused kernel.

Kept apart from ``optimizer.py`` (the wrapper's step, scaling and state) because these checks run
once, on the optimizer as the user built it, and name what to change.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from .training.master_weights import HALF


def check_fused(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> None:
    """Refuse ``fused=True`` groups of optimizer class ``cls`` whose fused kernel DTensor cannot run.

    Every parameter of a parallelized model is a DTensor, and DTensor runs an operator only if it
    has a rule for it: torch 2.13 has one for Adam's and AdamW's fused kernels, none for SGD's
    (``aten._fused_sgd_``). One step of the same optimizer class and settings on a one-element
    replicated DTensor (on a parameter's mesh, device and stepped dtype; no communication) finds
    out before the first real step, for whatever optimizer and torch version.

    Raises:
        NotImplementedError: naming the optimizer and the operator DTensor lacks, with the
            ``foreach=True`` alternative (the same arithmetic, one kernel per operation over all
            tensors).
    """
    accepted = inspect.signature(cls).parameters
    for group in groups:
        like = next((p for p in group["params"] if isinstance(p, DTensor)), None)
        if not group.get("fused") or like is None:
            continue
        dtype = torch.float32 if like.dtype in HALF else like.dtype  # half ones step as fp32 masters
        local = torch.zeros(1, dtype=dtype, device=like.to_local().device)
        probe = torch.nn.Parameter(DTensor.from_local(local, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                                                      run_check=False))
        probe.grad = DTensor.from_local(torch.zeros_like(local), like.device_mesh, probe.placements, run_check=False)
        settings = {k: v for k, v in group.items() if k != "params" and k in accepted}
        try:
            cls([probe], **settings).step()
        except (RuntimeError, NotImplementedError) as e:
            raise NotImplementedError(
                f"{cls.__name__}(fused=True) on this model's parameters (DTensors): "
                f"{str(e).splitlines()[0]}. Use foreach=True, which does the same arithmetic") from None


def _owners(params, models: list) -> list:
    """The models (of ``models``, in order) holding any of ``params``.

    Raises:
        ValueError: if some parameters belong to none of them: wrapping replaces a model's
            parameters with sharded ones, so an optimizer built before wrapping would update
            tensors nothing reads.
    """
    params = list(params)
    holders = [(m, {id(p) for p in m.module.parameters()}) for m in models]
    foreign = sum(1 for p in params if not any(id(p) in ids for _, ids in holders))
    if foreign:
        raise ValueError(
            f"{foreign} of the optimizer's {len(params)} parameters do not belong to any "
            "smp.DistributedModel. The optimizer must be created after smp.DistributedModel(...), "
            "from model.parameters(): wrapping replaces the model's parameters with sharded ones, "
            "so an optimizer created before wrapping would update tensors the model no longer uses.")
    return [m for m, ids in holders if any(id(p) in ids for p in params)]
