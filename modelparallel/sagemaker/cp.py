"""Context parallelism's batch helpers for scripts (the API layer over ``context.layout``).

A context-parallel rank passes the model its part of every sequence: chunks r and 2C-1-r of 2C
(``context.layout``). ``get_batch_for_cp_rank`` cuts that part out of a batch every rank of the
context-parallel group loaded alike (the helper SageMaker v2's example scripts define, here in
the library); ``gather_sequence`` puts the whole sequence back together from every rank's part
(logits or hidden states for evaluation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import runtime
from ..context import layout


def get_batch_for_cp_rank(batch: Any, seq_dim: int = 1) -> Any:
    """This rank's part of ``batch``: each tensor cut along ``seq_dim`` into 2 x cp_size chunks,
    chunks cp_rank and 2 x cp_size - 1 - cp_rank kept (concatenated). ``batch`` is a tensor or a
    tuple / list of tensors (None entries pass through); unchanged at context degree 1.

    Raises:
        ValueError: a sequence length not divisible by 2 x ``context_parallel_degree``, naming it.
    """
    size, rank = runtime.cp_size(), runtime.cp_rank()
    if isinstance(batch, torch.Tensor):
        return layout.split(batch, size, rank, seq_dim)
    return type(batch)(None if t is None else layout.split(t, size, rank, seq_dim) for t in batch)


def gather_sequence(tensor: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence of ``tensor`` (this rank's part along ``seq_dim``) on every rank of the
    context-parallel group, in sequence order. A collective over that group: call it on each."""
    rt = runtime.current()
    size = rt.config.context_parallel_degree
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=rt.group(runtime.CP_GROUP))
    return layout.merge(parts, seq_dim)
