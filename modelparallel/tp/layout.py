"""Shard arithmetic in one place: which block of a global tensor each rank holds.

DTensor's ``Shard(dim)`` splits a dimension like ``torch.chunk``: pieces of ceil(size / parts),
the last ones shorter or empty (a vocabulary of 50257 at TP=4 gives 12565, 12565, 12565, 12562).
Everything here follows DTensor's own rule: a block (any placements, any mesh coordinate) comes
from DTensor's helper, a one-dimensional range is that rule written out, and a full tensor
becomes a shard through ``distribute_tensor`` without communication (``src_data_rank=None``:
every rank slices the full tensor it already holds). Nothing else in the package computes a
shard's extent.

Also here, because every layer needs them and they answer the same question (what one rank
holds of which tensor, under which name): a rank's local part of a tensor or gradient, the names
that share one tensor (tied parameters), and the prefix a head model puts before its base
model's names.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ..compat import compute_local_shape_and_global_offset

K = TypeVar("K", bound=Hashable)


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of piece ``index`` when ``size`` rows are split in ``parts`` like DTensor's
    ``Shard`` (``torch.chunk``): ceil(size / parts) per piece, the last ones shorter or empty.

    Raises:
        ValueError: ``parts`` < 1 or ``index`` outside [0, parts).
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"shard {index} of {parts}: need parts >= 1 and 0 <= index < parts")
    per = -(-size // parts)
    start = min(index * per, size)
    return start, min(start + per, size)


def rank_coordinate(mesh: DeviceMesh, rank: int) -> list[int]:
    """The coordinate of global ``rank`` in ``mesh``.

    Raises:
        ValueError: ``rank`` is not in ``mesh``.
    """
    where = (mesh.mesh == rank).nonzero()
    if len(where) != 1:
        raise ValueError(f"rank {rank} is not in mesh {mesh}")
    return where[0].tolist()


def local_block(t: DTensor, coordinate: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the block of DTensor ``t`` held at mesh ``coordinate``
    (this rank's by default). Every placement this library makes (TP shards, FSDP over TP)
    gives each rank one contiguous block of the global tensor."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate() if coordinate is None else coordinate
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh.shape, list(coordinate), t.placements)
    return tuple(shape), tuple(offset)


def block_of(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of the part of ``t``'s global tensor this rank holds: a DTensor's local
    block, or the whole of a plain tensor."""
    if isinstance(t, DTensor):
        return local_block(t)
    return tuple(t.shape), (0,) * t.dim()


def block_slices(shape: Sequence[int], offset: Sequence[int]) -> tuple[slice, ...]:
    """Index of the block (``shape`` at ``offset``) in its global tensor: ``full[block_slices(...)]``."""
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def distribute(full: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    """A DTensor laid out by ``placements`` from ``full``, which every rank already holds whole:
    each rank keeps its own block, no communication."""
    return distribute_tensor(full, mesh, placements, src_data_rank=None)


def distribute_like(full: torch.Tensor, like: DTensor) -> DTensor:
    """``full`` (``like``'s global shape) laid out like ``like``, on its device, without communication."""
    return distribute(full.to(like.device), like.device_mesh, like.placements)


def from_local_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor laid out like ``like`` whose shard on this rank is ``local`` (same local shape;
    any dtype). No communication and no check across ranks."""
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` for ``like``: the local shard a DTensor ``like`` holds (no
    communication), or ``full`` itself for a plain tensor."""
    if isinstance(like, DTensor):
        return distribute_like(full, like).to_local()
    return full


def assemble(pieces: Sequence[torch.Tensor], dim: int, shape: Sequence[int]) -> torch.Tensor:
    """The global tensor of ``shape`` from every rank's ``Shard(dim)`` piece, in rank order (the
    inverse of ``shard_of`` on a one-dimensional mesh; empty trailing pieces are fine).

    Raises:
        ValueError: the pieces do not make up ``shape``.
    """
    out = torch.cat(list(pieces), dim=dim)
    if list(out.shape) != list(shape):
        raise ValueError(f"shards of a {list(shape)} tensor reassemble to {list(out.shape)}")
    return out


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t``: a DTensor's local shard, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's gradient of ``p`` (the local shard for a DTensor parameter), or None."""
    return None if p.grad is None else local_part(p.grad)


def tie_groups(items: Iterable[tuple[K, torch.Tensor]]) -> list[list[K]]:
    """Names grouped by the tensor object they hold, each group and each name in first-seen order.

    A tie (GPT-2's ``wte.weight`` and ``lm_head.weight``) is one tensor under several names;
    ``module.state_dict(keep_vars=True).items()`` lists it once per name.
    """
    groups: dict[int, list[K]] = {}
    for name, t in items:
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def tied_parameters(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """(module path, module, attribute) of every holder of each parameter held by more than one
    (module, attribute); a module reachable by several paths counts once."""
    holders: dict[int, dict[tuple[int, str], tuple[str, nn.Module, str]]] = {}
    for mpath, mod in model.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), {})[(id(mod), name)] = (mpath, mod, name)
    return [list(h.values()) for h in holders.values() if len(h) > 1]


def base_prefix(model: nn.Module) -> str:
    """The attribute under which a head model (``GPT2LMHeadModel``) holds its base model
    (``transformer``), which prefixes the base model's keys and module paths; "" for a base
    model itself or a model without one."""
    prefix = getattr(model, "base_model_prefix", "")
    return prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


def copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's piece of ``full`` (``target``'s global shape) into ``target``: a
    DTensor's local shard, or the whole of a plain tensor. No communication."""
    with torch.no_grad():
        local_part(target).copy_(shard_of(full.to(target.dtype), target))
