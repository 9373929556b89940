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
from torch.distributed.tensor import DTensor

from ..pipeline.split import elsewhere
from ..tp.layout import local_part, shard_of, tie_groups


class _Keys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class LoadReport(_Keys):
    """What a load left out: keys the model (or optimizer) has and the source lacks, keys only
    the source has, and ``"key: checkpoint (..), model (..)"`` shape mismatches (those a
    non-strict load skips).

    It unpacks as ``missing, unexpected = model.load_state_dict(...)``, like the pair torch's
    ``nn.Module.load_state_dict`` returns; ``mismatched_shapes`` is an attribute beside the pair.
    """

    mismatched_shapes: list[str]

    def __new__(cls, missing_keys: list[str], unexpected_keys: list[str], mismatched_shapes: list[str] | None = None):
        self = super().__new__(cls, missing_keys, unexpected_keys)
        self.mismatched_shapes = list(mismatched_shapes or [])
        return self

    def __repr__(self) -> str:
        return (f"LoadReport(missing_keys={self.missing_keys!r}, unexpected_keys={self.unexpected_keys!r}, "
                f"mismatched_shapes={self.mismatched_shapes!r})")

    def __eq__(self, other) -> bool:
        same = super().__eq__(other)
        if same is NotImplemented or not isinstance(other, LoadReport):
            return same
        return same and self.mismatched_shapes == other.mismatched_shapes

    def __ne__(self, other) -> bool:
        same = self.__eq__(other)
        return same if same is NotImplemented else not same

    __hash__ = None

    @property
    def mismatched_keys(self) -> set[str]:
        """The keys named in ``mismatched_shapes``."""
        return {m.split(": ")[0] for m in self.mismatched_shapes}

    def problems(self, part: str) -> list[str]:
        """One line per missing / unexpected key list and per shape (or ``config ...``: structural
        config entry) mismatch, prefixed by ``part``."""
        out = [f"{part}: missing keys (in the model, not in the checkpoint): {self.missing_keys}"] \
            if self.missing_keys else []
        if self.unexpected_keys:
            out.append(f"{part}: unexpected keys (in the checkpoint, not in the model): {self.unexpected_keys}")
        out += [f"{part}: {m}" if m.startswith("config ") else f"{part}: shape mismatch {m}"
                for m in self.mismatched_shapes]
        return out


def _entries(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by key, with tied tensors kept as the same object."""
    return module.state_dict(keep_vars=True)


def full_state_dict(module: nn.Module, gather_to_rank0: bool = False,
                    pp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """Every tensor gathered to its global shape (a collective: every rank must call it).

    Tied tensors are gathered once and share one tensor in the result. With ``gather_to_rank0``
    only global rank 0 keeps the result; the others return ``{}`` after taking part. For a model
    split into pipeline stages, ``pp_group`` is this rank's pipeline group: every stage's
    entries are gathered over it (a weight tied across stages again one tensor under both keys).
    """
    keep = not gather_to_rank0 or dist.get_rank() == 0
    entries = _entries(module)
    full = {}
    for keys in tie_groups(entries.items()):
        t = entries[keys[0]]
        full.update(dict.fromkeys(keys, (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()))
    full = {key: full[key] for key in entries}
    if pp_group is not None:
        full = _from_every_stage(full, module, pp_group, gather_to_rank0)
    return full if keep else {}


def _from_every_stage(full: dict, module: nn.Module, group: dist.ProcessGroup, to_first: bool) -> dict:
    """The union of every pipeline stage's full entries (on the group's first rank only when
    ``to_first``), in stage order."""
    stages: list = [None] * dist.get_world_size(group)
    if to_first:
        dist.gather_object(full, stages if dist.get_rank(group) == 0 else None, group=group, group_dst=0)
    else:
        dist.all_gather_object(stages, full, group=group)
    if stages[0] is None:
        return {}
    union = {k: v for stage in stages for k, v in stage.items()}
    for dup, keep in module._mp_stage.ties.items():
        union[dup] = union[keep]
    return union


def local_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every tensor (replicated tensors whole)."""
    return {k: local_part(t).detach() for k, t in _entries(module).items()}


def _tie_groups(entries: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Key -> every key holding the same tensor (itself included)."""
    return {key: keys for keys in tie_groups(entries.items()) for key in keys}


def _source_shard(key, target, src, same_partition_load: bool) -> tuple[torch.Tensor | None, str | None]:
    """The local piece of ``src`` for ``target``, or an error message naming the shapes."""
    local_shape = local_part(target).shape
    if same_partition_load:
        if src.shape == local_shape:
            return src, None
        return None, (f"{key}: same_partition_load expects this rank's shard {tuple(local_shape)}, found "
                      f"{tuple(src.shape)} (saved with another layout? load with same_partition_load=False)")
    if src.shape == target.shape:
        return shard_of(src, target), None
    if src.shape == local_shape:
        return src, None
    return None, f"{key}: expected shape {tuple(target.shape)} (this rank's shard {tuple(local_shape)}), found {tuple(src.shape)}"


def load_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True,
                    same_partition_load: bool = False) -> LoadReport:
    """Load a full or local state dict into a tensor-parallel module; no collectives.

    Raises:
        KeyError / ValueError: (when ``strict``) listing every missing or unexpected key, and
            always for shape mismatches; nothing is copied unless every entry fits.
    """
    entries = _entries(module)
    ties = _tie_groups(entries)
    unexpected = sorted(set(state_dict) - set(entries) - elsewhere(module))
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
            local_part(target).copy_(piece)
    return LoadReport(missing, unexpected)
