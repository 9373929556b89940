"""Make every parameter a tensor-parallel group holds whole equal to TP rank 0's, once, at wrap.

The ranks of a TP group each build the whole model before it is sharded. A sharded parameter
keeps only each rank's own block, so it does not matter that the ranks drew different values;
a replicated one (position embeddings, layer norms, a vocabulary not split over the ranks, the
row-parallel biases) must be the same on every rank, or the ranks compute different functions
and a partial checkpoint, which stores one copy, resumes into a different model. SageMaker's
example scripts seed every TP rank differently before the model is built, and SageMaker
synchronizes replicated parameters over the TP group when it wraps the model; so do we.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

BUCKET_BYTES = 32 * 2**20
"""Largest flat buffer one broadcast carries: bounds the extra memory to one bucket."""


def replicated_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The local tensors of every parameter ``module`` holds whole on each TP rank (plain
    tensors, and DTensors replicated along "tp" or on a mesh without it: expert-parallel experts
    are the same experts on every TP rank of a group), each once, in a fixed order."""
    out, seen = [], set()
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if isinstance(p, DTensor):
            if _whole_on_tp_ranks(p):
                out.append(p.to_local())
        elif not p.is_meta:
            out.append(p)
    return out


def _whole_on_tp_ranks(p: DTensor) -> bool:
    names = p.device_mesh.mesh_dim_names or ()
    if "tp" in names:
        return isinstance(p.placements[names.index("tp")], Replicate)
    return all(isinstance(pl, Replicate) for pl in p.placements) or "ep" in names


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Same-dtype, same-device groups of at most ``BUCKET_BYTES`` (a larger tensor alone)."""
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.dtype, t.device)].append(t)
    out = []
    for group in by_kind.values():
        bucket, size = [], 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            out.append(bucket)
    return out


@torch.no_grad()
def broadcast_replicated(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Overwrite every replicated parameter of ``module`` with TP rank 0's values (a collective
    over the TP group; every rank of it must call it, with the same model)."""
    if tp_mesh.size() == 1:
        return
    group = tp_mesh.get_group()
    for bucket in _buckets(replicated_tensors(module)):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, group=group, group_src=0)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
