"""The optimizer part of a partial checkpoint, read and written without touching the live optimizer.

Layout (DCP keys, compatible with ``get_optimizer_state_dict``'s):

* ``optimizer.state.{param name}.{slot}``: each state slot (``exp_avg``, ``step``...) of each
  parameter that has state, a DTensor placed like its parameter when it has the parameter's
  shape (so it reshards with it), else a plain tensor (``step``);
* ``optimizer.param_groups.{i}.{hyperparameter}``: each group's hyperparameters, and its
  ``params`` as the list of parameter names;
* ``loss_scaler.{field}``: the loss scaler's state.

Saving reads the optimizer's ``state`` as it is: an optimizer that has not stepped saves an empty
state (nothing is initialized: torch's own helper would run a step with lr=0 to create the
slots, which changes AdamW's step count and, in half precision, the weights). Loading builds
the target tensors from the checkpoint's metadata (shape, dtype; placement from the parameter),
reads into them (verified while read), and only then replaces the optimizer's state and
hyperparameters: the new tensors are the staging, the old state is freed when they replace it.
An optimizer that has stepped thus holds two copies of its state (and of its fp32 master weights)
until then; a load through an undo journal (``plan_load(reuse=True)``) targets the live slots and
masters instead, read through buckets.

To add another per-parameter tensor to this part (e.g. fp32 master weights), put it under a key
prefix listed in ``PARAM_KEYED`` (``{prefix}{param name}.{slot}``) in ``optimizer_state`` and
read it back from the loaded dict in ``apply_optimizer_state``: targets are created from the
metadata the same way.

The keys and saved names live in ``optim_keys``, the load's planning in ``optim_plan``; both are
re-exported here.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...pipeline.split import elsewhere, saved_names
from ...tp.layout import local_part
from ...training.optimizer_state import load_masters
from .optim_keys import (  # noqa: F401 - part of this module's API
    GROUPS, MASTERS, PARAM_KEYED, SCALE, SCALER, STATE, _params, _split, param_names, scaler_state)
from .optim_plan import Planned, plan_load, read_target  # noqa: F401 - part of this module's API


def group_names_everywhere(module: nn.Module, optimizer, pp_group) -> list[list[str]] | None:
    """The saved names of every parameter group, over all pipeline stages (each stage holds
    its own parameters of each group): a collective of the pipeline group; None for a model
    that is not split."""
    if not saved_names(module) and not elsewhere(module):
        return None
    names = param_names(module)
    mine = [[names[id(p)] for p in g["params"]] for g in optimizer.optimizer.param_groups]
    stages: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    return [list(dict.fromkeys(n for stage in stages for n in (stage[i] if i < len(stage) else [])))
            for i in range(max(len(s) for s in stages))]


def optimizer_state(module: nn.Module, optimizer, everywhere: list[list[str]] | None = None) -> dict[str, Any]:
    """The part to save: the live state by parameter name (no copies, nothing initialized).
    ``everywhere``: each group's names over all pipeline stages (``group_names_everywhere``)."""
    inner, names = optimizer.optimizer, param_names(module)
    state = {names[id(p)]: dict(slots) for p, slots in inner.state.items() if slots}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": everywhere[i] if everywhere is not None else [names[id(p)] for p in g["params"]]}
              for i, g in enumerate(inner.param_groups)]
    out = {"optimizer": {"state": state, "param_groups": groups}, "loss_scaler": optimizer.loss_scaler.state_dict()}
    masters = {names[id(p)]: {"master": m} for p, m in optimizer.master_weights.pairs}
    if masters:
        out[MASTERS.rstrip(".")] = masters
    return out


def apply_optimizer_state(module: nn.Module, optimizer, loaded: dict[str, Any]) -> None:
    """Replace the optimizer's state, hyperparameters and loss scaler with ``loaded`` (read by
    ``plan_load`` + DCP). Tensors are used as read: no dtype cast, no copy."""
    inner = optimizer.optimizer
    params = _params(module)
    check_scaler(optimizer, loaded)
    scaler = scaler_state(loaded)
    saved_groups = loaded["optimizer"]["param_groups"]
    if len(saved_groups) == len(inner.param_groups):
        for group, saved in zip(inner.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
    state = defaultdict(dict)
    for name, slots in loaded["optimizer"]["state"].items():
        state[params[name]] = slots
    inner.state = state
    if scaler is not None:  # absent (strict=False): the live scaler is kept, and reported missing
        optimizer.loss_scaler.load_state_dict(scaler)
    saved = loaded.get(MASTERS.rstrip("."), {})
    names = param_names(module)
    load_masters(optimizer, {i: saved[names[id(p)]]["master"] for i, (p, m) in
                             enumerate(optimizer.master_weights.params_and_masters())
                             if m is not p and names[id(p)] in saved} or None)
    _masters_into_fp32_params(optimizer, names, saved)


@torch.no_grad()
def _masters_into_fp32_params(optimizer, names: dict[int, str], saved: dict) -> None:
    """Copy each saved master planned for an fp32 parameter without a master (``_plan_master``)
    into it: the model part holds that weight rounded to half precision, the master is what the
    saving job stepped, so the resumed job steps on from the same numbers."""
    for p, m in optimizer.master_weights.params_and_masters():
        value = saved.get(names[id(p)], {}).get("master")
        if m is p and value is not None and p.dtype == torch.float32:
            local_part(p).copy_(local_part(value))



def check_scaler(optimizer, loaded: dict[str, Any]) -> None:
    """Raise (changing nothing) if the saved loss-scaler state cannot be applied."""
    if (state := scaler_state(loaded)) is not None:
        copy.deepcopy(optimizer.loss_scaler).load_state_dict(state)


def check_names_against_model(module: nn.Module, metadata) -> list[str]:
    """Problems visible before the optimizer exists: saved slots of parameters this model lacks
    or at another shape (checked when the model is built, before any weight is loaded)."""
    saved = metadata.state_dict_metadata
    params = _params(module)
    others = elsewhere(module)
    problems = []
    for key, md in saved.items():
        split = _split(key, params)
        if split is None or not isinstance(md, TensorStorageMetadata) or split[1] in others:
            continue
        param = params.get(split[1])
        if param is None:
            problems.append(f"optimizer: state for {split[1]!r}, which this model does not have")
        elif tuple(md.size) not in ((), tuple(param.shape)):
            problems.append(f"optimizer: shape mismatch {key}: checkpoint {tuple(md.size)}, model {tuple(param.shape)}")
    return sorted(set(problems))
