"""The global gradient norm of a sharded model, and clipping by it.

Each rank holds pieces of the gradients: a TP-sharded parameter's shard, an FSDP shard of that,
or a whole replicated parameter that other ranks hold too. The global norm must count every
element exactly once, as if one process held the whole model. A rank therefore weights its
local sum of ``|g|^p`` by ``distinct / world``, where ``distinct`` is how many different
pieces the parameter is cut into (the product of the mesh sizes along its ``Shard`` placements):
each piece is held by ``world / distinct`` ranks, so the world-wide sum of the weighted values
counts each piece once. One all-reduce of one number per norm then gives the global norm on
every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from ..tp.layout import local_part


def _distinct_pieces(g: torch.Tensor) -> int:
    """Distinct blocks ``g`` is cut into across ranks: every placement that is not Replicate
    (Shard, and FSDP2's strided shard of a TP shard, which is not a Shard subclass); 1 for a
    replicated tensor."""
    if not isinstance(g, DTensor):
        return 1
    if any(isinstance(pl, Partial) for pl in g.placements):
        raise ValueError(f"gradient norm: a gradient of shape {tuple(g.shape)} is a pending sum "
                         f"(placements {g.placements}); reduce it before clipping")
    return math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())


def grad_pieces(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """(this rank's block of the gradient, distinct blocks it is cut into) for every parameter
    of ``params`` holding a gradient."""
    return [(local_part(p.grad), _distinct_pieces(p.grad)) for p in params if p.grad is not None]


def norm_of_pieces(pieces: Iterable[tuple[torch.Tensor, int]], norm_type: float = 2.0,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The norm of all ``pieces`` over the whole job, each element counted once.

    Each piece is (a local tensor, how many distinct blocks its global tensor is cut into across
    ``group``'s ranks): the local ``sum |g|^p`` is weighted by ``distinct / world``. A collective
    over ``group`` (default: the world), which must contain every rank that holds a piece.
    Returns an fp32 scalar tensor, the same on every rank.
    """
    norm_type = float(norm_type)
    pieces = list(pieces)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64)
    for block, distinct in pieces:
        shard = block.detach().double()
        if shard.numel() == 0:
            continue
        if inf:
            total = torch.maximum(total, shard.abs().max().cpu())
        else:
            total += shard.abs().pow(norm_type).sum().cpu() * (distinct / world)
    if world > 1:
        device = pieces[0][0].device if pieces else torch.device("cpu")
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        flat = total.to(device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        total = flat.cpu()
    norm = total if inf else total.pow(1.0 / norm_type)
    return norm.float()


def global_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The norm of all gradients of ``params`` over the whole job, each element counted once
    (``norm_of_pieces`` of ``grad_pieces``)."""
    return norm_of_pieces(grad_pieces(params), norm_type, group)


@torch.no_grad()
def clip_pieces(pieces: list[tuple[torch.Tensor, int]], max_norm: float, norm_type: float = 2.0,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the local tensors of ``pieces`` in place so their global norm is at most
    ``max_norm``, with the coefficient of ``torch.nn.utils.clip_grad_norm_`` (``max_norm /
    (norm + 1e-6)``, capped at 1). Returns the global norm before clipping."""
    norm = norm_of_pieces(pieces, norm_type, group)
    coef = float(max_norm) / (norm.item() + 1e-6)
    if coef < 1.0:
        for block, _ in pieces:
            block.mul_(coef)
    return norm


def clip_by_global_norm(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``clip_pieces`` over the gradients of ``params``.

    Returns:
        The global norm before clipping.
    """
    return clip_pieces(grad_pieces(params), max_norm, norm_type, group)
