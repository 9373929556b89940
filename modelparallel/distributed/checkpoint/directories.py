"""Saving and loading over a group whose ranks name different directories.

SageMaker's scripts write one sharded checkpoint directory per tensor- and expert-parallel rank
(``tp{i}_ep{j}``), each saved over the FSDP process group. Here FSDP1 shards the dense parameters
over every data-parallel rank, so under expert parallelism that group spans several expert
ranks, and so several directories: saved as one DCP checkpoint, only the coordinator's directory
would get a ``.metadata`` (and the files of every rank would be scattered over the others).

So each directory is made a whole checkpoint of what its ranks need to resume: every dense
entry (each rank of the group writes its shard into every directory: the dense state is stored
once per expert rank, as it would be if each expert rank's FSDP group held it whole), and the
experts held by the ranks naming the directory (as the block of the expert tensors those ranks
hold, ``group_blocks.block_of``). One DCP save per directory, over the whole group (its
collectives), coordinated by a rank naming that directory. Loading, each rank reads its own
directory, asking for the experts as the same block.

Expert entries are the DTensors on a mesh with an ``"ep"`` dimension.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ... import devices
from .group_blocks import block_of
from .outcome import Group
from .directory import writer_for


def split(group: Group, path) -> dict[str, list[int]] | None:
    """The ranks of ``group`` naming each directory (a collective over ``group``), by absolute
    path in sorted order (the same on every rank); None when every rank names the same one."""
    if len(group.members) == 1:  # a group of one names one directory
        return None
    mine = os.path.abspath(os.fspath(path))
    if _all_name(group, mine):
        return None
    paths: list = [None] * len(group.members)
    dist.all_gather_object(paths, mine, group=group.pg)
    if len(set(paths)) == 1:
        return None
    return {p: [r for r, q in zip(group.members, paths) if q == p] for p in sorted(set(paths))}


def _all_name(group: Group, path: str) -> bool:
    """Whether every rank of ``group`` names ``path`` (one all-reduce of a 63-bit digest of it,
    its smallest and largest value over the ranks: a quarter of the time of gathering the
    paths themselves, which each asynchronous save's call pays)."""
    digest = int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little") >> 1
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=devices.for_group(group.pg))
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group.pg)
    return int(both[0]) == -int(both[1])


def coordinator(group: Group, ranks: list[int]) -> Group:
    """``group`` coordinated by a rank of ``ranks``: the given coordinator when it is one of them."""
    return Group(group.pg, group.coordinator if group.coordinator in ranks else min(ranks))


def save_each(save, state_dict, writer, group: Group) -> None:
    """``save(state_dict, writer, group)`` once, or, when the ranks of ``group`` name different
    directories (``split``), once per directory in the same order on every rank: this rank's own
    with its experts as its directory's block, the others without experts, each coordinated by a
    rank naming that directory."""
    by_path = split(group, writer.path)
    if by_path is None:
        save(state_dict, writer, group)
        return
    mine = os.path.abspath(writer.path)
    for path, ranks in by_path.items():
        if path == mine:
            with experts_as_blocks(state_dict, ranks):
                save(state_dict, writer, coordinator(group, ranks))
        else:
            save(without_experts(state_dict), writer_for(path, None), coordinator(group, ranks))


def own_ranks(group: Group, path) -> list[int] | None:
    """The ranks of ``group`` naming this rank's directory ``path`` (a collective), or None when
    every rank names it."""
    by_path = split(group, path)
    return None if by_path is None else by_path[os.path.abspath(path)]


def _is_expert(value) -> bool:
    return isinstance(value, DTensor) and "ep" in (value.device_mesh.mesh_dim_names or ())


def without_experts(obj):
    """A copy of the nested dicts and lists of ``obj`` without its expert entries (the leaves are
    the same objects)."""
    if isinstance(obj, dict):
        return {k: without_experts(v) for k, v in obj.items() if not _is_expert(v)}
    if isinstance(obj, list):
        return [without_experts(v) for v in obj if not _is_expert(v)]
    return obj


def _expert_slots(obj, prefix: str = ""):
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if _is_expert(v):
            yield obj, k, f"{prefix}{k}"
        elif isinstance(v, (dict, list)):
            yield from _expert_slots(v, f"{prefix}{k}.")


@contextlib.contextmanager
def experts_as_blocks(state_dict, ranks: list[int] | None):
    """Within the block, every expert entry of ``state_dict`` (changed in place) is the block of
    it that ``ranks`` hold, sharing its local tensor (a load into it lands in the model); the
    originals come back on exit. ``ranks`` None: nothing changes."""
    if ranks is None:
        yield state_dict
        return
    swapped, members, inside = [], set(ranks), {}
    try:
        for container, key, name in list(_expert_slots(state_dict)):
            block = block_of(container[key], members, name, inside)
            if block is not None:
                swapped.append((container, key, container[key]))
                container[key] = block
        yield state_dict
    finally:
        for container, key, original in reversed(swapped):
            container[key] = original
