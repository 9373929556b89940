"""Data parallelism without sharding: average gradients over the data-parallel group.

Gradients are flattened into one buffer per dtype so a step costs one all-reduce per dtype
rather than one per parameter (the bucketing idea of PyTorch DDP, Li et al. 2020).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..tp.layout import local_grad


def allreduce_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """Average the gradients of ``params`` over ``group`` (``size`` ranks), in place."""
    if size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        g = local_grad(p)
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
