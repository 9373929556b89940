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
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ...pipeline.split import elsewhere, saved_names
from ...tp.layout import from_local_like, local_part
from ...training.optimizer_state import load_masters
from .parts import LoadReport

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


def _split(key: str, params: dict[str, torch.Tensor]) -> tuple[str, str, str] | None:
    """(prefix, param name, slot) of a parameter-keyed entry, or None."""
    for prefix in PARAM_KEYED:
        if key.startswith(prefix):
            name, _, slot = key[len(prefix):].rpartition(".")
            return (prefix, name, slot) if name else None
    return None


def read_target(param: torch.Tensor | None, md: TensorStorageMetadata) -> torch.Tensor:
    """A new empty tensor to read a saved entry into, placed like ``param`` if it has its shape
    (never the optimizer's own slot: nothing live changes until the whole part is read)."""
    size, dtype = tuple(md.size), md.properties.dtype
    if isinstance(param, DTensor) and tuple(param.shape) == size:
        local = param.to_local()
        return from_local_like(torch.empty(local.shape, dtype=dtype, device=local.device), param)
    device = param.to_local().device if isinstance(param, DTensor) else getattr(param, "device", "cpu")
    return torch.empty(size, dtype=dtype, device=device)


@dataclass
class Planned:
    """The nested state to read the optimizer part into, built from the checkpoint's metadata,
    and what already does not fit; ``report()`` once the ``param_groups`` entries are read."""

    nested: dict[str, Any]
    group_keys: set[str]
    live: set[str]
    unexpected: set[str]
    mismatched: list[str]
    ours: int
    others: set[str] = frozenset()
    """Parameters other pipeline stages hold: listed in the groups, not unexpected here."""
    reused: dict[str, tuple[dict, str]] = field(default_factory=dict)
    """Entries whose target is the live optimizer's own tensor (``plan_load(reuse=True)``):
    flattened key -> (the dict of ``nested`` holding it, its key there)."""

    def report(self) -> LoadReport:
        """Missing: this optimizer's parameters that the checkpoint's groups do not list;
        unexpected: names only the checkpoint has; mismatched: a slot whose shape is neither the
        parameter's nor a scalar, or another number of parameter groups."""
        groups = self.nested["optimizer"]["param_groups"]
        listed = {n for g in groups for n in _listed(g)}
        mismatched = list(self.mismatched)
        if groups and len(groups) != self.ours:
            mismatched.append(f"param_groups: checkpoint has {len(groups)}, this optimizer {self.ours}")
        scaler = [] if scaler_state(self.nested) is not None else [f"{SCALER}{SCALE}"]
        return LoadReport((sorted(self.live - listed) if groups else []) + scaler,
                          sorted(self.unexpected | (listed - self.live - self.others)), mismatched)


def plan_load(module: nn.Module, optimizer, metadata, reuse: bool = False) -> Planned:
    """Targets for every saved entry of the part whose DCP ``metadata`` is given (no collective,
    nothing read). ``reuse``: a state slot the optimizer already holds at the saved shape, dtype
    and placement is its own target (the caller then must read through an undo journal)."""
    saved = metadata.state_dict_metadata
    params = _params(module)
    names = param_names(module)
    others = elsewhere(module)
    slots_now = _live_slots(optimizer, names) if reuse else {}
    live_masters = _live_slots(optimizer, names)[MASTERS]
    reused = {}
    live = {names[id(p)] for g in optimizer.optimizer.param_groups for p in g["params"]}
    state: dict[str, dict] = {}
    masters: dict[str, dict] = {}
    groups: dict[int, dict] = {}
    scaler: dict[str, Any] = {}
    unexpected, mismatched = set(), []
    for key, md in saved.items():
        split = _split(key, params)
        if split is not None:
            prefix, name, slot = split
            param = params.get(name)
            bucket = state if prefix == STATE else masters
            if name not in live:
                if name not in others:
                    unexpected.add(name)
            elif prefix == MASTERS:
                _plan_master(key, md, param, live_masters.get(name), masters, reused, slots_now)
            elif not isinstance(md, TensorStorageMetadata):  # a non-tensor slot: read (restricted) as is
                bucket.setdefault(name, {})[slot] = None
            elif tuple(md.size) not in ((), tuple(param.shape)):
                mismatched.append(f"{key}: checkpoint {tuple(md.size)}, model {tuple(param.shape)}")
            elif _reusable(existing := slots_now.get(prefix, {}).get(name, {}).get(slot), param, md):
                bucket.setdefault(name, {})[slot] = existing
                reused[key] = (bucket[name], slot)
            else:
                bucket.setdefault(name, {})[slot] = read_target(param, md)
        elif key.startswith(GROUPS):
            index, _, field = key[len(GROUPS):].partition(".")
            groups.setdefault(int(index), {})[field] = _placeholder(md)
        elif key.startswith(SCALER):
            scaler[key[len(SCALER):]] = _placeholder(md)
    if sorted(groups) != list(range(len(groups))):
        raise ValueError(f"the optimizer part's parameter groups {sorted(groups)} are not numbered 0..n-1")
    nested = {"optimizer": {"state": state, "param_groups": [groups[i] for i in sorted(groups)]},
              "loss_scaler": scaler}
    if masters:
        nested[MASTERS.rstrip(".")] = masters
    group_keys = {f"{GROUPS}{i}.{f}" for i, g in groups.items() for f in g}
    return Planned(nested, group_keys, live, unexpected, mismatched, len(optimizer.optimizer.param_groups), others,
                   reused)


def _plan_master(key: str, md, param: torch.Tensor, live: dict | None, masters: dict, reused: dict,
                 slots_now: dict) -> None:
    """Plan a saved fp32 master: it must be a tensor of its live master's global shape and dtype
    (checked here, before anything is read or changed, not when it is copied in). Where the
    parameter has no master but is itself fp32 of that shape (sharded data parallelism keeps
    fp32 shards and computes in half precision), the master is read for the parameter; where it
    is neither, the master is not read (nothing would hold it).

    Raises:
        ValueError: naming the key, the saved and the expected shape or dtype.
    """
    if live is None:
        if not (isinstance(md, TensorStorageMetadata) and param is not None and param.dtype == torch.float32
                and md.properties.dtype == torch.float32 and tuple(md.size) == tuple(param.shape)):
            return
        live = {"master": param}
    want = live["master"]
    if not isinstance(md, TensorStorageMetadata):
        raise ValueError(f"{key}: an fp32 master weight saved as a {type(md).__name__}, not a tensor")
    size, dtype = tuple(md.size), md.properties.dtype
    if size != tuple(want.shape) or dtype != want.dtype:
        raise ValueError(f"{key}: checkpoint {size} {dtype}, this optimizer's master weight {tuple(want.shape)} "
                         f"{want.dtype}")
    name = key[len(MASTERS):].rpartition(".")[0]
    existing = slots_now.get(MASTERS, {}).get(name, {}).get("master")
    if _reusable(existing, param, md):
        masters.setdefault(name, {})["master"] = existing
        reused[key] = (masters[name], "master")
    else:
        masters.setdefault(name, {})["master"] = read_target(param, md)


def _live_slots(optimizer, names: dict[int, str]) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """prefix -> parameter name -> slot -> the live tensor a saved entry would replace: the
    optimizer's state slots and the fp32 master weights of half-precision parameters."""
    masters = {names[id(p)]: {"master": m} for p, m in optimizer.master_weights.params_and_masters() if m is not p}
    return {STATE: {names[id(p)]: slots for p, slots in optimizer.optimizer.state.items()}, MASTERS: masters}


def _reusable(existing, param: torch.Tensor | None, md: TensorStorageMetadata) -> bool:
    """Whether the live slot ``existing`` is exactly what ``read_target`` would make for ``md``."""
    size, dtype = tuple(md.size), md.properties.dtype
    if not isinstance(existing, torch.Tensor) or tuple(existing.shape) != size or existing.dtype != dtype:
        return False
    if isinstance(param, DTensor) and tuple(param.shape) == size:
        return isinstance(existing, DTensor) and existing.placements == param.placements \
            and existing.device_mesh == param.device_mesh and existing.to_local().shape == param.to_local().shape
    return not isinstance(existing, DTensor)


def _placeholder(md) -> Any:
    return torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None


def _listed(group: dict) -> list[str]:
    """A saved group's parameter names."""
    names = group.get("params")
    return names if isinstance(names, list) else []


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


def scaler_state(loaded: dict[str, Any]) -> dict | None:
    """The saved loss-scaler state, None if the checkpoint holds none (e.g. the pipeline stage
    that saved it is missing): ``strict=True`` refuses that, ``strict=False`` keeps the live one."""
    state = loaded.get("loss_scaler") or {}
    return state if SCALE in state else None


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
