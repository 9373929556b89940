"""The global gradient norm of a sharded model, and clipping by it.

Each rank holds pieces of the gradients: a TP-sharded parameter's shard, an FSDP shard of that,
or a whole replicated parameter that other ranks hold too. The global norm must count every
element exactly once, as if one process held the whole model. A rank therefore weights its
local sum of ``|g|^p`` by ``distinct / world``, where ``distinct`` is how many different
pieces the parameter is cut into (the product of the mesh sizes along its ``Shard`` placements):
each piece is held by ``world / distinct`` ranks, so the world-wide sum of the weighted values
counts each piece once. One all-reduce of one number per norm then gives the global norm on
every rank. Under pipeline parallelism a parameter lives on its stage's ranks only, so
``holders`` says how many ranks hold it (``world / stages``), and a weight two stages hold (a
tied embedding) is counted by one of them (the other says 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

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


def global_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0,
                     group: dist.ProcessGroup | None = None, holders: Callable[[torch.Tensor], int] | None = None
                     ) -> torch.Tensor:
    """The norm of all gradients of ``params`` over the whole job, each element counted once.

    A collective over ``group`` (default: the world), which must contain every rank that
    holds a piece of the parameters. ``holders(p)``: how many ranks of the group hold a copy of
    ``p`` (default: all of them); 0 leaves ``p`` to another rank's copy. Returns an fp32 scalar
    tensor, the same on every rank.
    """
    norm_type = float(norm_type)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    pairs = [(p.grad, holders(p) if holders is not None else world) for p in params if p.grad is not None]
    grads = [g for g, _ in pairs]
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64)
    for g, held_by in pairs:
        shard = local_part(g).detach().double()
        if shard.numel() == 0 or held_by == 0:
            continue
        if inf:
            total = torch.maximum(total, shard.abs().max().cpu())
        else:
            weight = _distinct_pieces(g) / held_by
            total += shard.abs().pow(norm_type).sum().cpu() * weight
    if world > 1:
        device = grads[0].device if grads else torch.device("cpu")
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        flat = total.to(device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        total = flat.cpu()
    norm = total if inf else total.pow(1.0 / norm_type)
    return norm.float()


@torch.no_grad()
def clip_by_global_norm(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        group: dist.ProcessGroup | None = None,
                        holders: Callable[[torch.Tensor], int] | None = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so their global norm is at most ``max_norm``, with the
    coefficient of ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``, capped at 1).

    Returns:
        The global norm before clipping.
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, norm_type, group, holders)
    coef = float(max_norm) / (norm.item() + 1e-6)
    if coef < 1.0:
        for p in params:
            g = p.grad
            local_part(g).mul_(coef)
    return norm
