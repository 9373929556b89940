"""``smp.clip_grad_norm_``: gradient clipping by the norm of the whole (unsharded) model.

A rank holds a mix of gradients: tensor-parallel shards (DTensors on the "tp" mesh), FSDP2
shards (DTensors on "dp", or on ("dp", "tp") over a TP shard) and replicated tensors (plain, the
same on every rank after the data-parallel average). Each distinct block of a gradient must
count once in the norm. A DTensor whose placements shard it over mesh dims of total size
``pieces`` is cut into ``pieces`` distinct blocks, each held by ``world / pieces`` ranks (every
rank holds the same model); a plain tensor is one block held by all ``world`` ranks. So each
rank adds ``|g|^p * pieces / world`` for its local block and one all-reduce over the world gives
the single-process ``sum |g|^p`` (for the infinity norm: the max, which needs no weighting).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial


def _pieces(g: torch.Tensor) -> int:
    """Number of distinct blocks ``g`` is cut into across ranks (1 for a replicated tensor)."""
    if not isinstance(g, DTensor):
        return 1
    n = 1
    for dim, placement in enumerate(g.placements):
        if isinstance(placement, Partial):
            raise ValueError(f"clip_grad_norm_: a gradient of shape {tuple(g.shape)} is a pending sum "
                             f"(placements {g.placements}); reduce it before clipping")
        if not placement.is_replicate():  # Shard, FSDP2's _StridedShard over a TP shard...
            n *= g.device_mesh.size(dim)
    return n


def _flattened_by_fsdp1(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_fsdp_flattened", False)) and not isinstance(p, DTensor)


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their total norm, over the whole model
    as one process would compute it, is at most ``max_norm``. A collective: call it on every
    rank, with the parameters of the same model.

    Args:
        parameters: the model's parameters (``model.parameters()``), a mix of TP-sharded,
            FSDP2-sharded and replicated ones; those without a gradient are skipped.
        max_norm: the largest norm allowed.
        norm_type: the p of the p-norm; ``float("inf")`` for the largest absolute value.

    Returns:
        The total norm before clipping (a plain scalar tensor, the same on every rank).

    Raises:
        NotImplementedError: for parameters flattened by FSDP1 (``FullyShardedDataParallel``),
            whose flat shards no longer say which of them are tensor-parallel; use
            ``fully_shard`` (FSDP2), or FSDP1's own ``model.clip_grad_norm_`` at TP degree 1.
        ValueError: for a gradient that is still a pending sum.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    flat = [p for p in params if _flattened_by_fsdp1(p)]
    if flat:
        raise NotImplementedError(
            f"clip_grad_norm_ over {len(flat)} parameters flattened by FSDP1 (FullyShardedDataParallel): "
            "their flat shards do not record which are tensor-parallel; wrap with fully_shard (FSDP2), "
            "or at tensor_parallel_degree 1 use the FSDP module's own clip_grad_norm_")
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local = (g.to_local() if isinstance(g, DTensor) else g).detach().float()
        if local.numel() == 0:
            continue
        if math.isinf(norm_type):
            total = torch.maximum(total, local.abs().max())
        else:
            total += local.abs().pow(norm_type).sum() * (_pieces(g) / world)
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
    return total
