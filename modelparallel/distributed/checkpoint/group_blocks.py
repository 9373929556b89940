"""Saving and loading DTensors with a process group that holds only part of their mesh.

SageMaker v2 checkpoints a model by groups of ranks: each tensor-parallel rank writes its own
directory with the FSDP process group (the data-parallel ranks holding its TP shard), each
replication group its own local directory. PyTorch's DCP describes a DTensor by its *global*
tensor; saved over a group that holds only part of the mesh (FSDP1's ("dp", "tp") DTensors over
the "dp" group), the group's chunks cover part of the tensor and DCP refuses the plan ("Failed
to validate global plan ... invalid fill tensor-volume: 64000 chunks-volume: 32000"), or with a
one-rank group writes a half-covered entry that later loads half of nothing.

What such a group holds is a *block*: the tensor as cut by the mesh dimensions that leave the
group (the TP block, for FSDP1's DTensors), sharded by the dimensions inside it. ``for_group``
swaps every such DTensor, in place in the (nested) state dict, for a DTensor of its block on the
sub-mesh of the inside dimensions, sharing the same local tensor (so a load into it lands in the
model), and puts the originals back afterwards. DTensors whose mesh the group covers, plain
tensors and ShardedTensors are left alone. ``install`` applies it inside DCP's own save and load
(``save``, ``load``, the deprecated ``save_state_dict`` / ``load_state_dict``) whenever a
process group is given, so scripts calling DCP directly get it too (and a ``coordinator_rank``
given as a global rank of the group, as the scripts give it, is read as that member).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...compat import compute_local_shape_and_global_offset, dcp_loader_module, dcp_saver_module

_MARK = "_mp_group_blocks"


def _inside_dims(mesh, members: set[int]) -> list[int] | None:
    """Mesh dimensions along which every rank through this one is in ``members`` (None when
    this rank is not on the mesh)."""
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    inside = []
    for dim in range(mesh.ndim):
        index = tuple(slice(None) if d == dim else c for d, c in enumerate(coord))
        if set(mesh.mesh[index].flatten().tolist()) <= members:
            inside.append(dim)
    return inside


def _strides(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _check_blocks_contiguous(t: DTensor, inside: list[int], key: str) -> None:
    """DTensor splits along the mesh dimensions in order; the group's chunks form one block only
    if no inside dimension plainly shards a tensor dimension that a later outside one shards too
    (FSDP2's strided shard over "dp" says exactly that its split comes after "tp"'s). A dimension
    of size 1 splits nothing (FSDP1 puts its shard on the root mesh's next-to-last dimension, which
    is "cp" in the world mesh: its TP blocks come whole on every data-parallel rank)."""
    for i in inside:
        pl = t.placements[i]
        if not pl.is_shard() or hasattr(pl, "split_factor") or t.device_mesh.size(i) == 1:
            continue
        later = [o for o in range(i + 1, t.device_mesh.ndim) if o not in inside
                 and t.placements[o].is_shard() and t.placements[o].dim == pl.dim]
        if later:
            raise NotImplementedError(
                f"saving {key or 'a DTensor'} over a process group: its placements {t.placements} shard dim "
                f"{pl.dim} inside the group before a dimension outside it, so the group holds no single block; "
                "save it with the whole mesh's group")


def _splits(placement) -> bool:
    """Whether ``placement`` splits a tensor dimension: a ``Shard``, or a strided one (split after
    the later mesh dimensions, which the block has already been cut by)."""
    return placement.is_shard() or hasattr(placement, "split_factor")


def block_of(t: DTensor, members: set[int], key: str = "", inside_by_mesh: dict | None = None) -> torch.Tensor | None:
    """The DTensor of the block of ``t`` the ranks ``members`` hold, or None when they cover
    ``t``'s mesh (nothing to change). ``inside_by_mesh``: what was worked out for the meshes and
    layouts seen so far (a state dict's DTensors share a few meshes and layouts; finding a mesh's
    inside dimensions reads the whole mesh).

    Raises:
        NotImplementedError: for a layout whose block is not a plain sharding of the inside
            dimensions (a pending sum, or a group that meets the mesh at this rank alone).
    """
    known = {} if inside_by_mesh is None else inside_by_mesh
    layout = (t.device_mesh, tuple(t.placements), tuple(t.shape))
    if layout not in known:
        known[layout] = _block_layout(t, members, key, known)
    block = known[layout]
    if block is None:
        return None
    local = t.to_local()
    if block == "local":
        return local
    sub, placements, block_shape, expect = block
    if tuple(expect) != tuple(local.shape):
        raise NotImplementedError(f"saving {key or 'a DTensor'} over a process group: its layout {t.placements} "
                                  f"on mesh {t.device_mesh.mesh_dim_names} is not a sharding of its block "
                                  f"{tuple(block_shape)} (this rank holds {tuple(local.shape)}, a sharding would give "
                                  f"it {tuple(expect)})")
    return DTensor.from_local(local, sub, placements, run_check=False, shape=torch.Size(block_shape),
                              stride=_strides(block_shape))


def _block_layout(t: DTensor, members: set[int], key: str, known: dict):
    """``block_of``'s answer for ``t``'s mesh, placements and shape: None (the group covers the
    mesh), ``"local"`` (the group meets the mesh at this rank alone: the local tensor), or the
    block's (sub-mesh, placements, shape, this rank's local shape)."""
    mesh = t.device_mesh
    if mesh not in known:
        known[mesh] = _inside_dims(mesh, members)
    inside = known[mesh]
    if inside is None or len(inside) == mesh.ndim:
        return None
    if any(pl.is_partial() for pl in t.placements):
        raise NotImplementedError(f"saving {key or 'a DTensor'} over a process group: a pending sum {t.placements}")
    if not inside:
        if members != {dist.get_rank()}:
            raise NotImplementedError(f"saving {key or 'a DTensor'} over a process group that meets its mesh "
                                      f"{mesh.mesh.tolist()} at this rank only")
        return "local"
    _check_blocks_contiguous(t, inside, key)
    outer = [Replicate() if d in inside else pl for d, pl in enumerate(t.placements)]
    block_shape, _ = compute_local_shape_and_global_offset(t.shape, mesh.shape, mesh.get_coordinate(), outer)
    names = mesh.mesh_dim_names
    if names is None:
        raise NotImplementedError(f"saving {key or 'a DTensor'} over a process group: its mesh has no dimension names")
    sub = mesh[tuple(names[d] for d in inside)] if len(inside) > 1 else mesh[names[inside[0]]]
    placements = [Shard(t.placements[d].dim) if _splits(t.placements[d]) else Replicate() for d in inside]
    expect, _ = compute_local_shape_and_global_offset(block_shape, sub.shape, sub.get_coordinate(), placements)
    return sub, placements, block_shape, expect


def _slots(obj, prefix: str = "") -> Iterator[tuple[object, object, str]]:
    """(container, key, dotted name) of every DTensor in a nested dict / list."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if isinstance(v, DTensor):
            yield obj, k, f"{prefix}{k}"
        elif isinstance(v, (dict, list)) and v:  # (names made only where needed: each save walks every entry)
            yield from _slots(v, f"{prefix}{k}.")


@contextlib.contextmanager
def for_group(state_dict, group: dist.ProcessGroup | None, known: dict | None = None):
    """Within the block, every DTensor of ``state_dict`` (nested dicts and lists, changed in
    place) whose mesh has ranks outside ``group`` is its block's DTensor; the originals come
    back on exit. No-op for ``group`` None (the world). ``known``: a dict the caller keeps
    between calls, where the blocks' layouts worked out for each group are kept (a repeated
    save meets the same meshes and layouts)."""
    if group is None or not isinstance(state_dict, (dict, list)):
        yield state_dict
        return
    members = set(dist.get_process_group_ranks(group))
    swapped = []
    inside_by_mesh = {} if known is None else known.setdefault(frozenset(members), {})
    try:
        for container, key, name in list(_slots(state_dict)):
            original = container[key]
            block = block_of(original, members, name, inside_by_mesh)
            if block is not None:
                container[key] = block
                swapped.append((container, key, original))
        yield state_dict
    finally:
        for container, key, original in reversed(swapped):
            container[key] = original


def _coordinator_as_group_rank(bound, group) -> None:
    """DCP reads ``coordinator_rank`` as a rank of the group; SageMaker v2 scripts pass a global one
    (``min(get_global_ranks(group))``). One that is no group rank but a member's global rank is
    read as that member."""
    rank = bound.arguments.get("coordinator_rank")
    if group is None or rank is None:
        return
    members = dist.get_process_group_ranks(group)
    if not 0 <= rank < len(members) and rank in members:
        bound.arguments["coordinator_rank"] = members.index(rank)


def _with_blocks(fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("process_group")
        _coordinator_as_group_rank(bound, group)
        with for_group(bound.arguments["state_dict"], group):
            return fn(*bound.args, **bound.kwargs)
    setattr(wrapped, _MARK, True)
    return wrapped


def install() -> None:
    """Make DCP's own save and load use ``for_group`` when given a process group (idempotent)."""
    for module, name in ((dcp_saver_module, "_save_state_dict"), (dcp_loader_module, "_load_state_dict")):
        fn = getattr(module, name)
        if not getattr(fn, _MARK, False):
            setattr(module, name, _with_blocks(fn))
