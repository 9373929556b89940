"""The optimizer part's keys (the layout ``optim_part`` describes) and the names parameters are
saved under in it: what saving, planning a load and applying one all agree on.

Kept apart so that ``optim_plan`` (reading) and ``optim_part`` (saving, applying) share one
definition of the layout without importing each other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...pipeline.split import saved_names

STATE, GROUPS, SCALER = "optimizer.state.", "optimizer.param_groups.", "loss_scaler."
SCALE = "loss_scale"
"""The one entry every loss scaler's state has."""
MASTERS = "fp16_states."
"""fp32 master weights of half-precision parameters: ``fp16_states.{param name}.master``."""
PARAM_KEYED = (STATE, MASTERS)
"""Key prefixes whose entries are ``{prefix}{param name}.{slot}`` and are placed like the parameter."""


def param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> the name it is saved under: its first name (a tied parameter is saved
    once, as in the model part), a weight tied across pipeline stages under its first stage's."""
    moved = saved_names(module)
    return {id(p): moved.get(n, n) for n, p in module.named_parameters()}


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by the name they are saved under."""
    names = param_names(module)
    return {names[id(p)]: p for p in module.parameters()}


def _split(key: str, params: dict[str, torch.Tensor]) -> tuple[str, str, str] | None:
    """(prefix, param name, slot) of a parameter-keyed entry, or None."""
    for prefix in PARAM_KEYED:
        if key.startswith(prefix):
            name, _, slot = key[len(prefix):].rpartition(".")
            return (prefix, name, slot) if name else None
    return None


def scaler_state(loaded: dict[str, Any]) -> dict | None:
    """The saved loss-scaler state, None if the checkpoint holds none (e.g. the pipeline stage
    that saved it is missing): ``strict=True`` refuses that, ``strict=False`` keeps the live one."""
    state = loaded.get("loss_scaler") or {}
    return state if SCALE in state else None
