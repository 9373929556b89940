"""``smp.clip_grad_norm_``: gradient clipping by the norm of the whole (unsharded) model.

A rank holds a mix of gradients: tensor-parallel shards (DTensors on the "tp" mesh), FSDP2
shards (DTensors on "dp", or on ("dp", "tp") over a TP shard), FSDP1 flat shards (a unit's
TP-local parameters flattened and split over its process group) and replicated tensors (plain,
the same on every rank after the data-parallel average). Each distinct block of a gradient must
count once in the norm. A block cut into ``pieces`` distinct blocks across the job is held by
``world / pieces`` ranks (every rank holds the same model), so each rank adds
``|g|^p * pieces / world`` for its local block and one all-reduce over the world gives the
single-process ``sum |g|^p`` (for the infinity norm: the max, which needs no weighting). That
arithmetic lives in ``training/grad_clip.py`` (shared with ``DistributedOptimizer.
clip_master_grads``), FSDP1's pieces in ``training/flat_grads.py``; this module adds the
user-facing forms: SageMaker v2 scripts call ``clip_grad_norm_(model, max_norm)`` with the FSDP
model itself, v1-style code passes parameters. Under pipeline parallelism a rank holds only its
stage: both forms weight each parameter by the ranks holding it (``pipeline.ties.norm_holders``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from . import runtime
from .pipeline.split import stage_within
from .pipeline.ties import norm_holders
from .training.flat_grads import flattened_by_fsdp1, fsdp1_units, unit_pieces
from .training.grad_clip import clip_by_global_norm, clip_pieces, grad_pieces, norm_of_pieces


def _stage_holders(modules) -> Callable[[torch.Tensor], int] | None:
    """How many ranks hold each parameter of pipelined ``modules`` (a stage's parameters are on
    world / stages ranks; a weight tied across stages is counted on its first stage only), or
    None when nothing is pipelined (every rank holds every parameter)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    held = norm_holders(modules, world)
    return (lambda p: held.get(id(p), world)) if held else None


def _clip_module(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip every gradient block of ``model`` (its FSDP1 units' flat shards, then the parameters
    no FSDP1 unit manages) by their global norm; under pipeline parallelism the norm weights each
    parameter by the ranks holding its stage and counts a cross-stage tie once, while every
    copy is scaled."""
    pieces = [piece for unit in fsdp1_units(model) for piece in unit_pieces(unit)]
    unmanaged = [p for p in model.parameters() if not flattened_by_fsdp1(p)]
    holders = _stage_holders(list(model.modules()))
    norm = None
    if holders is not None:  # an FSDP1 unit lives on one stage: its blocks are on world / stages ranks
        stages = stage_within(model).count
        norm = norm_of_pieces([(block, n * stages) for block, n in pieces] + grad_pieces(unmanaged, holders),
                              norm_type)
    return clip_pieces(pieces + grad_pieces(unmanaged), max_norm, norm_type, norm=norm)


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients in place so their total norm, over the whole model as one process
    would compute it, is at most ``max_norm``. A collective: call it on every rank, with the
    same model.

    Args:
        parameters: the model itself (any mix of tensor parallelism, FSDP1 ``FullyShardedDataParallel``
            units, ``fully_shard`` and plain replicated parameters, as SageMaker v2's
            ``clip_grad_norm_(model, max_norm)``), or its parameters (``model.parameters()``:
            TP-sharded, FSDP2-sharded and replicated ones); those without a gradient are skipped.
        max_norm: the largest norm allowed.
        norm_type: the p of the p-norm; ``float("inf")`` for the largest absolute value.

    Returns:
        The total norm before clipping (a plain scalar tensor, the same on every rank).

    Raises:
        NotImplementedError: for parameters (not the module) flattened by FSDP1, whose flat
            shards no longer say which of them are tensor-parallel: pass the FSDP module itself.
        ValueError: for a gradient that is still a pending sum.
    """
    if isinstance(parameters, nn.Module):
        return _clip_module(parameters, max_norm, norm_type)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    flat = [p for p in params if flattened_by_fsdp1(p) and not isinstance(p, DTensor)]
    if flat:
        raise NotImplementedError(
            f"clip_grad_norm_ over {len(flat)} parameters flattened by FSDP1 (FullyShardedDataParallel): "
            "their flat shards do not record which are tensor-parallel; pass the FSDP module itself, "
            "clip_grad_norm_(model, max_norm)")
    holders = _stage_holders([m.module for m in runtime.current().models]) if runtime.is_initialized() else None
    return clip_by_global_norm(params, max_norm, norm_type, holders=holders)
