"""The optimizer part of a partial checkpoint for an optimizer with fp32 master weights.

Entries, in the DCP key layout of ``get_optimizer_state_dict`` (so the part reads like any
other optimizer part): ``optimizer.state.{param name}.{slot}`` (fp32, placed like the parameter),
``optimizer.param_groups.{i}.{hyperparameter}``, ``loss_scaler.{field}``, plus the masters as
``fp16_states.{param name}.master`` (SageMaker keeps them in its ``fp16_states`` files).

Built from the optimizer's live tensors by name, without torch's helper, which would cast the
state to the half-precision parameters' dtype on load. An optimizer that never stepped has its
fp32 state slots created on the masters with a zero-learning-rate step, only when it is being
loaded into (everything is then overwritten); saving one saves no slots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from ..optimizer_state import load_masters

PART = "fp16_states"


def has_masters(optimizer) -> bool:
    return optimizer is not None and len(getattr(optimizer, "master_weights", ())) > 0


def _names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name (a tied parameter counted once, as in the model part)."""
    return {id(p): n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}


def optimizer_state(module: nn.Module, optimizer, load_from: Path | None = None) -> dict[str, Any]:
    """The part, referencing the live state tensors and masters (DCP reads into them in place).
    ``load_from``: the saved part about to be loaded (slots are created if missing; masters are
    left out if it has none, and recreated by ``apply``)."""
    inner, names = optimizer.optimizer, _names(module)
    if load_from is not None and not inner.state:
        _create_state(optimizer)
    state = {names[id(p)]: dict(slots) for p, slots in inner.state.items() if slots}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in inner.param_groups]
    out = {"optimizer": {"state": state, "param_groups": groups}, "loss_scaler": optimizer.loss_scaler.state_dict()}
    if load_from is None or _has_masters_saved(load_from):
        out[PART] = {names[id(p)]: {"master": m} for p, m in optimizer.master_weights.pairs}
    return out


def _has_masters_saved(directory: Path) -> bool:
    saved = FileSystemReader(directory).read_metadata().state_dict_metadata
    return any(key.startswith(PART + ".") for key in saved)


@torch.no_grad()
def _create_state(optimizer) -> None:
    """fp32 state slots for every parameter: a step with zero gradients and lr 0 on the masters."""
    mw = optimizer.master_weights
    with mw.masters_in_optimizer() as inner:
        lrs = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
            for t in g["params"]:
                t.grad = torch.zeros_like(t)
        try:
            inner.step()
        finally:
            for g, lr in zip(inner.param_groups, lrs):
                g["lr"] = lr
                for t in g["params"]:
                    t.grad = None


def apply(optimizer, loaded: dict[str, Any]) -> None:
    """After the DCP read into ``optimizer_state(..., for_load=True)``'s tensors (state and
    masters are already in place): the hyperparameters, the loss scaler, and the masters
    recreated from the weights if the checkpoint had none."""
    for group, saved in zip(optimizer.optimizer.param_groups, loaded["optimizer"]["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.loss_scaler.load_state_dict(loaded["loss_scaler"])
    if PART not in loaded:
        load_masters(optimizer, None)
