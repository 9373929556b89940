"""Planning a load of the optimizer part: a target tensor for every saved entry, built from the
checkpoint's metadata (shape, dtype; placement from the parameter) before anything is read, and
what already does not fit (unexpected, mismatched, missing).

Kept apart from ``optim_part`` because this side decides, with no collective and nothing read or
changed, where each entry will go; ``optim_part`` saves the live state and applies what was read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ...pipeline.split import elsewhere
from ...tp.layout import from_local_like
from .optim_keys import GROUPS, MASTERS, SCALE, SCALER, STATE, _params, _split, param_names, scaler_state
from .parts import LoadReport


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
    and placement is its own target (the caller then must read through an undo journal). A
    parameter with a slot at another shape (reported mismatched) gets none of its saved state:
    with ``strict=False`` it starts afresh, as one without saved state does."""
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
    unexpected, mismatched, misfit = set(), [], set()
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
                misfit.add(name)
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
    for name in misfit:  # all of a parameter's state or none: a step finding exp_avg_sq without exp_avg fails
        holder = state.pop(name, None)
        reused = {k: v for k, v in reused.items() if v[0] is not holder}
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
