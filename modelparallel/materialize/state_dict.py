"""Full and local state dicts of a tensor-parallel module, and loading either one back.

The full (distributed-format) state dict has every tensor at its global shape, which does not
depend on the TP degree: it is what a later load at any degree slices from. A local state dict
holds this rank's shards. Loading checks every key and shape first and copies nothing unless all
of them fit, so a bad state dict never leaves a model half-loaded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _entries(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by key, with tied tensors kept as the same object."""
    return module.state_dict(keep_vars=True)


def full_state_dict(module: nn.Module, gather_to_rank0: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor gathered to its global shape (a collective: every rank must call it).

    Tied tensors are gathered once and share one tensor in the result. With ``gather_to_rank0``
    only global rank 0 keeps the result; the others return ``{}`` after taking part.
    """
    keep = not gather_to_rank0 or dist.get_rank() == 0
    out, done = {}, {}
    for key, t in _entries(module).items():
        if id(t) not in done:
            full = t.full_tensor() if isinstance(t, DTensor) else t
            done[id(t)] = full.detach().cpu()
        if keep:
            out[key] = done[id(t)]
    return out


def local_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every tensor (replicated tensors whole)."""
    return {k: (t.to_local() if isinstance(t, DTensor) else t).detach() for k, t in _entries(module).items()}


def _tie_groups(entries: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    groups: dict[int, list[str]] = {}
    for key, t in entries.items():
        groups.setdefault(id(t), []).append(key)
    return {key: keys for keys in groups.values() for key in keys}


def _source_shard(key, target, src, same_partition_load: bool) -> tuple[torch.Tensor | None, str | None]:
    """The local piece of ``src`` for ``target``, or an error message naming the shapes."""
    local_shape = target.to_local().shape if isinstance(target, DTensor) else target.shape
    if same_partition_load:
        if src.shape == local_shape:
            return src, None
        return None, (f"{key}: same_partition_load expects this rank's shard {tuple(local_shape)}, found "
                      f"{tuple(src.shape)} (saved with another layout? load with same_partition_load=False)")
    if src.shape == target.shape:
        if isinstance(target, DTensor):
            return distribute_tensor(src.to(target.device), target.device_mesh, target.placements,
                                     src_data_rank=None).to_local(), None
        return src, None
    if src.shape == local_shape:
        return src, None
    return None, f"{key}: expected shape {tuple(target.shape)} (this rank's shard {tuple(local_shape)}), found {tuple(src.shape)}"


def load_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True,
                    same_partition_load: bool = False) -> LoadResult:
    """Load a full or local state dict into a tensor-parallel module; no collectives.

    Raises:
        KeyError / ValueError: (when ``strict``) listing every missing or unexpected key, and
            always for shape mismatches; nothing is copied unless every entry fits.
    """
    entries = _entries(module)
    ties = _tie_groups(entries)
    unexpected = sorted(set(state_dict) - set(entries))
    missing = sorted(k for k in entries if not any(t in state_dict for t in ties[k]))
    problems, copies, seen = [], [], set()
    for key, target in entries.items():
        src_key = next((t for t in ties[key] if t in state_dict), None)
        if src_key is None or id(target) in seen:
            continue
        seen.add(id(target))
        piece, err = _source_shard(src_key, target, state_dict[src_key], same_partition_load)
        if err:
            problems.append(err)
        else:
            copies.append((target, piece))
    if strict and (missing or unexpected):
        problems.insert(0, f"missing keys {missing}; unexpected keys {unexpected}")
    if problems:
        raise ValueError("cannot load state dict:\n  - " + "\n  - ".join(problems))
    with torch.no_grad():
        for target, piece in copies:
            dst = target.to_local() if isinstance(target, DTensor) else target
            dst.copy_(piece)
    return LoadResult(missing, unexpected)
