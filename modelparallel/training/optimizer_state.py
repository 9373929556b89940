"""``DistributedOptimizer.state_dict()`` / ``local_state_dict()`` in SageMaker's layout, and loading.

The layout is torch's own (``state`` by parameter index, ``param_groups``) with SageMaker's
``_smp_is_partial`` flag, so code written for a torch optimizer state dict reads it, plus what a
resume needs: ``loss_scaler`` (the scale and its counters) and ``fp32_from_fp16``, the fp32
master weights by parameter index. Masters hold more precision than the fp16/bf16 weights the
model saves, so a resumed run continues bit-exactly only if they are restored too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..tp.layout import distribute_like, from_local_like, local_part, shard_of

logger = logging.getLogger("modelparallel")

MASTERS = "fp32_from_fp16"


def state_dict(optimizer, partial: bool) -> dict[str, Any]:
    """SageMaker's layout of a ``DistributedOptimizer``'s state; with ``partial``, DTensor
    entries are this rank's local shards (views of the live tensors, nothing copied)."""
    conv = local_part if partial else (lambda t: t)
    inner = optimizer.optimizer.state_dict()
    state = {i: {k: conv(v) if isinstance(v, DTensor) else v for k, v in slots.items()}
             for i, slots in inner["state"].items()}
    masters = {i: conv(m.detach()) for i, (p, m) in enumerate(optimizer.master_weights.params_and_masters())
               if m is not p}
    return {"state": state, "param_groups": inner["param_groups"], "_smp_is_partial": partial,
            "loss_scaler": optimizer.loss_scaler.state_dict(), MASTERS: masters}


def load_state_dict(optimizer, sd: Mapping[str, Any]) -> None:
    """Load any layout ``state_dict`` produced (this one, the earlier ``{"optimizer": ...,
    "loss_scaler": ...}``, or a plain torch optimizer's), at any TP degree."""
    torch_sd = sd["optimizer"] if "optimizer" in sd else {"state": sd["state"], "param_groups": sd["param_groups"]}
    with optimizer.master_weights.masters_in_optimizer() as inner:  # torch casts state to fp32
        inner.load_state_dict(to_param_layout(inner, torch_sd))
    if "loss_scaler" in sd:
        optimizer.loss_scaler.load_state_dict(sd["loss_scaler"])
    load_masters(optimizer, sd.get(MASTERS))


@torch.no_grad()
def load_masters(optimizer, masters: Mapping[int, torch.Tensor] | None) -> None:
    """Copy saved masters into the optimizer's; without any, recreate them from the model's
    current weights (load the model first) and say so once per optimizer."""
    mw = optimizer.master_weights
    if not len(mw):
        return
    pairs = list(mw.params_and_masters())
    if not masters:
        mw.params_to_masters()
        if not mw.recreated:
            mw.recreated = True
            logger.warning("the optimizer state has no fp32 master weights (saved in fp32, or by an "
                           "older version): recreated them from the model's half-precision weights")
        return
    for index, value in masters.items():
        p, t = pairs[int(index)]
        if t is p:
            raise ValueError(f"saved fp32 master for parameter {index}, which is not half precision here")
        local_part(t).copy_(_local_piece(t, value, index))


def _local_piece(master: torch.Tensor, value: torch.Tensor, index) -> torch.Tensor:
    """This rank's piece of a saved master: a DTensor's shard, a global tensor (``smp.load`` at
    another TP degree) sliced like ``master`` without communication, or a local shard as is."""
    if isinstance(value, DTensor):
        value = value.to_local()
    want = local_part(master)
    if isinstance(master, DTensor) and tuple(value.shape) == tuple(master.shape) != tuple(want.shape):
        value = shard_of(value, master)
    if tuple(value.shape) != tuple(want.shape):
        raise ValueError(f"saved fp32 master for parameter {index} has shape {tuple(value.shape)}; "
                         f"expected {tuple(master.shape)} (global) or {tuple(want.shape)} (this rank's shard)")
    return value


def to_param_layout(torch_optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state dict whose entries for DTensor parameters are plain tensors (global
    shape from ``smp.load`` at another degree, or this rank's shard) made DTensors like their
    parameter: torch's own load would keep them plain, and the next step would mix the two."""
    params = [p for g in torch_optimizer.param_groups for p in g["params"]]
    state = {}
    for index, slots in state_dict["state"].items():
        p = params[int(index)]
        state[index] = {k: _like(p, v) for k, v in slots.items()} if isinstance(p, DTensor) else slots
    return {**state_dict, "state": state}


def _like(param: DTensor, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if value.shape == param.shape:  # global: each rank slices its own shard, no communication
        return distribute_like(value, param)
    if value.shape == param.to_local().shape:  # this rank's shard, same layout
        return from_local_like(value.to(param.device), param)
    return value  # e.g. Adam's scalar step: torch's load handles it
