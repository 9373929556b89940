"""``smp.clip_grad_norm_``: gradient clipping by the norm of the whole (unsharded) model.

A rank holds a mix of gradients: tensor-parallel shards (DTensors on the "tp" mesh), FSDP2
shards (DTensors on "dp", or on ("dp", "tp") over a TP shard) and replicated tensors (plain, the
same on every rank after the data-parallel average). Each distinct block of a gradient must
count once in the norm. A DTensor whose placements shard it over mesh dims of total size
``pieces`` is cut into ``pieces`` distinct blocks, each held by ``world / pieces`` ranks (every
rank holds the same model); a plain tensor is one block held by all ``world`` ranks. So each
rank adds ``|g|^p * pieces / world`` for its local block and one all-reduce over the world gives
the single-process ``sum |g|^p`` (for the infinity norm: the max, which needs no weighting).
That arithmetic lives in ``grad_clip`` (shared with ``DistributedOptimizer.clip_master_grads``);
this module adds the user-facing checks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import runtime
from .pipeline.ties import norm_holders
from .training.grad_clip import clip_by_global_norm


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
    held = norm_holders([m.module for m in runtime.current().models], dist.get_world_size()) \
        if runtime.is_initialized() else {}
    return clip_by_global_norm(params, max_norm, norm_type,
                               holders=(lambda p: held.get(id(p), dist.get_world_size())) if held else None)
