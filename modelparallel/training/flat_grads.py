"""The gradients of a model wrapped in PyTorch FSDP1, as pieces for the global norm.

FSDP1 keeps each unit's gradients in one flat tensor: on each rank, its shard of the
concatenation of the unit's (TP-local) parameters. Counting every element of the whole model
once needs, per element, how many ranks hold it: a flat shard is this rank's alone within the
unit's process group (the whole group, or the shard group under hybrid sharding), or the whole
flat gradient is held by every rank of the group without sharding; and an element of a
tensor-parallel parameter belongs to one of that parameter's TP blocks (FSDP1 records the
DTensor layout of each parameter it flattened). So each original parameter's slice of the flat
shard is one piece whose global tensor is cut into (shard group size if sharded, else 1) x
(TP blocks of the parameter) distinct blocks, which is what ``grad_clip.norm_of_pieces`` weighs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy


def fsdp1_units(model: nn.Module) -> list[FullyShardedDataParallel]:
    """The FSDP1 units in ``model`` (itself included) that hold a flat parameter."""
    return [m for m in FullyShardedDataParallel.fsdp_modules(model) if getattr(m, "_flat_param", None) is not None]


def _tp_blocks(extension) -> int:
    """Distinct TP blocks of a flattened parameter, from FSDP1's record of its DTensor layout
    (None for a plain, replicated tensor)."""
    if extension is None:
        return 1
    mesh, placements = extension.mesh, extension.placements
    return math.prod(mesh.size(i) for i, pl in enumerate(placements) if not pl.is_replicate())


def unit_pieces(unit: FullyShardedDataParallel) -> list[tuple[torch.Tensor, int]]:
    """(slice of the unit's local flat gradient, distinct blocks) for each original parameter
    whose elements this rank holds; empty when the unit has no gradient."""
    flat = unit._flat_param
    grad = flat.grad
    if grad is None:
        return []
    sharded = unit.sharding_strategy != ShardingStrategy.NO_SHARD
    fsdp_blocks = dist.get_world_size(unit.process_group) if sharded else 1
    pieces = []
    for info, extension in zip(flat._shard_param_infos, flat._param_extensions):
        if info.in_shard and info.numel_in_shard:
            block = grad[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
            pieces.append((block, fsdp_blocks * _tp_blocks(extension)))
    return pieces


def flattened_by_fsdp1(p: torch.Tensor) -> bool:
    """Whether ``p`` is an FSDP1 flat parameter or one of its views."""
    return bool(getattr(p, "_fsdp_flattened", False))
