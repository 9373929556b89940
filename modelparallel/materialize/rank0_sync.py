"""The sync from rank 0 behind ``transform(load_state_dict_from_rank0=True)`` and
``DistributedModel`` of a model only rank 0 holds: every rank learns every rank's meta state,
then, once each rank's shards have storage, rank 0 sends every rank exactly its block of each
tensor (point to point, in one fixed order every rank follows; replicated tensors by
broadcast). No rank but 0 ever holds more than its shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..tp.layout import block_slices, local_block, rank_coordinate
from . import meta


def meta_states(module: nn.Module) -> list[tuple[bool, bool]]:
    """(has any meta tensor, has any real tensor) of every rank's model (a collective)."""
    names = meta.named_tensors(module)
    state = [False, False]
    for _, _, _, t in names:
        state[0 if meta.is_meta(t) else 1] = True
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, tuple(state))
    return out


def check_rank0_source(states: list[tuple[bool, bool]]) -> None:
    """Raise on every rank alike if rank 0 does not hold a complete real model."""
    if states[0][0]:
        raise meta.MetaTensorError("load_state_dict_from_rank0=True needs real weights on rank 0, but rank 0's "
                                   "model has tensors on the meta device")


def move(module: nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> None:
    """Move real tensors to ``device`` and cast floating ones to ``dtype``; meta tensors only
    change dtype (they have no data to move)."""
    def fn(t: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else None
        return t.to(device=None if t.is_meta else device, dtype=cast)
    if device is not None or dtype is not None:
        module._apply(fn)


def _coordinate(t: DTensor, rank: int, root) -> list[int]:
    """Mesh coordinate of global ``rank`` in ``t``'s mesh, found through a mesh of every rank
    naming ``t``'s dimensions (the runtime's expert mesh: a TP or expert-parallel mesh of another
    group does not contain rank 0)."""
    coord = rank_coordinate(root, rank)
    return [coord[root.mesh_dim_names.index(n)] for n in t.device_mesh.mesh_dim_names]


def _send_sharded(t: DTensor, src: torch.Tensor | None, root) -> None:
    local = t.to_local()
    if dist.get_rank() != 0:
        dist.recv(local, src=0)
        return
    full = src.to(t.dtype).reshape(t.shape)
    for r in range(dist.get_world_size()):
        shape, offset = local_block(t, _coordinate(t, r, root))
        piece = full[block_slices(shape, offset)]
        if r == 0:
            local.copy_(piece)
        else:
            dist.send(piece.contiguous(), dst=r)


def sync_from_rank0(module: nn.Module, full: dict[str, torch.Tensor], root) -> None:
    """Fill every tensor of ``module`` (already given storage) from rank 0's ``full`` tensors
    (qualified name -> data; empty on other ranks). Every rank walks the same tensors in the same
    order; each receives only its own block of sharded ones."""
    seen = set()
    with torch.no_grad():
        for qname, _, _, t in list(meta.named_tensors(module)):
            if id(t) in seen:
                continue
            seen.add(id(t))
            if isinstance(t, DTensor):
                _send_sharded(t, full.get(qname), root)
                continue
            if dist.get_rank() == 0:
                t.copy_(full[qname].reshape(t.shape))
            dist.broadcast(t, src=0)


SYNCED_FROM_RANK0 = "_mp_synced_from_rank0"
"""Attribute set on a model whose every tensor ``transform(load_state_dict_from_rank0=True)``
filled from rank 0: ``DelayedParamIniter`` of it then has nothing left to initialize."""
