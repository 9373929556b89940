"""Weights tied across pipeline stages (GPT-2's ``wte`` and ``lm_head``, BERT's word embeddings
and MLM decoder): one weight held by two stages.

Each of the two stages computes a part of its gradient (the embedding lookup's, the head's); the
weight's gradient is their sum, so after the step's data-parallel average the two ranks of each
pair (same data-parallel and tensor-parallel coordinates) all-reduce the tied gradients. Both
then hold the same sum bit for bit (addition of two numbers commutes), take the same optimizer
step and stay equal, as Megatron-LM does for its embedding group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..compat import default_group_timeout
from ..meshes import kept
from ..tp.layout import from_local_like, local_grad, local_part
from .split import Stage


def _pairs(stage: Stage) -> set[tuple[int, int]]:
    return {(stage.owner[keep], stage.owner[dup]) for dup, keep in stage.ties.items()}


def tied_parameters(module: nn.Module, stage: Stage) -> list[tuple[nn.Parameter, tuple[int, int]]]:
    """This stage's parameters that are one copy of a cross-stage tie, with the (stages) pair."""
    params = dict(module.named_parameters(remove_duplicate=False))
    out = []
    for dup, keep in stage.ties.items():
        pair = (stage.owner[keep], stage.owner[dup])
        name = keep if stage.owner[keep] == stage.index else dup if stage.owner[dup] == stage.index else None
        if name is not None and name in params:
            out.append((params[name], pair))
    return out


def pair_groups(stage: Stage, world_mesh, cache=None) -> dict[tuple[int, int], dist.ProcessGroup | None]:
    """For each pair of stages sharing a weight, this rank's two-rank group (None if this rank's
    stage is not in the pair). A collective: every rank creates every group, in one order, or
    takes it from ``cache`` (``meshes.MeshCache``: every model split the same way reuses them;
    each gloo group keeps its threads for the life of the process)."""
    grid = world_mesh.mesh  # [pp, dp, cp, tp]
    groups = {}
    for a, b in sorted(_pairs(stage)):
        enum = [(int(grid[a, d, c, t]), int(grid[b, d, c, t]))
                for d in range(grid.shape[1]) for c in range(grid.shape[2]) for t in range(grid.shape[3])]
        groups[(a, b)] = kept(cache, ("pipeline tie pairs", tuple(enum)),
                              lambda enum=enum: dist.new_subgroups_by_enumeration(
                                  [list(e) for e in enum], timeout=default_group_timeout())[0])
    return groups


@torch.no_grad()
def sum_tied_grads(tied: list[tuple[nn.Parameter, tuple[int, int]]], groups: dict) -> None:
    """Give both copies of every cross-stage tie the sum of their gradients (a copy that got
    none, because its stage did not use it, contributes zeros)."""
    for p, pair in tied:
        if p.grad is None:
            zeros = torch.zeros_like(local_part(p))
            p.grad = from_local_like(zeros, p) if isinstance(p, DTensor) else zeros
        dist.all_reduce(local_grad(p), group=groups[pair])


def norm_holders(modules, world: int) -> dict[int, int]:
    """For a global gradient norm: id of each parameter of the split ``modules`` -> how many
    ranks hold a copy (``world / stages``), 0 for the copy of a weight an earlier stage counts."""
    out = {}
    for module in modules:
        stage = getattr(module, "_mp_stage", None)
        if stage is None:
            continue
        for name, p in module.named_parameters(remove_duplicate=False):
            out[id(p)] = 0 if name in stage.ties or out.get(id(p)) == 0 else world // stage.count
    return out


@torch.no_grad()
def sync_tied_weights(tied: list[tuple[nn.Parameter, tuple[int, int]]], groups: dict) -> None:
    """Give the copy of every cross-stage tie the first stage's values (after each stage
    initialized its own parameters from its own random stream)."""
    for p, pair in tied:
        dist.broadcast(local_part(p), group=groups[pair], group_src=0)
