"""Whole parameters inside a head-sharded region: replicated key/value heads and per-head norms.

Between a column-parallel layer and its row-parallel partner each rank computes on its own heads
only. A parameter that is whole on every rank but used there sees only this rank's heads, so its
gradient on one rank is a part of the true one: Megatron's ``f`` applied to the parameter
itself (identity forward, all-reduce of the gradient backward) makes it the sum over the ranks,
the same on every rank, exactly as one process computes it.

Two styles use this. ``replicated_grad_sum``: a module kept whole that every rank applies to its
own heads (Qwen3's ``q_norm`` / ``k_norm``, RMSNorms over ``head_dim``). ``kv_replicated``: a
key or value projection when the degree does not divide the key/value heads (grouped-query
attention with 8, 4, 2 or 1 KV heads at a larger degree): the weight stays whole (a replicated
DTensor: checkpoints hold HF's tensor, whatever the degree) and each rank computes the KV heads
its query heads read, ``heads_for_rank`` below. The gradient of a KV head shared by several ranks
is the sum of their parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel.style import ParallelStyle

from .layout import local_part
from .local import _distribute, column_input, copy_to_tp, with_forward


def heads_for_rank(heads: int, kv_heads: int, tp: int, rank: int) -> tuple[list[int], int]:
    """The KV heads rank ``rank`` computes, in order, and the query heads per KV head on it.

    Query heads are split in order (rank r holds ``heads / tp`` consecutive ones) and HF's
    attention repeats each KV head for ``heads / kv_heads`` consecutive query heads. When all of a
    rank's query heads read one KV head (``kv_heads`` divides ``tp``) the rank holds that head
    once; otherwise each local query head gets its own copy of the KV head it reads (one group
    per head), which keeps the repeat count the same on every rank.

    Raises:
        ValueError: when ``tp`` does not divide ``heads`` or ``kv_heads`` does not divide ``heads``.
    """
    if heads % tp or heads % kv_heads:
        raise ValueError(f"{heads} query heads, {kv_heads} KV heads: the degree {tp} must divide the query heads "
                         "and the KV heads must divide them")
    per_rank, group = heads // tp, heads // kv_heads
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    if per_rank % group == 0:
        return sorted({h // group for h in mine}), group
    if group % per_rank == 0:
        return [mine[0] // group], per_rank
    return [h // group for h in mine], 1


class _GradSumForward:
    """Forward of a module whose own parameters pass through ``f`` on their way in."""

    def forward(self, *args, **kwargs):
        mesh = self.__dict__["_mp_grad_sum_mesh"]
        names = [n for n, p in self._parameters.items() if p is not None]
        for name in names:  # the instance attribute shadows the parameter for this call
            self.__dict__[name] = copy_to_tp(local_part(self._parameters[name]), mesh)
        try:
            return super().forward(*args, **kwargs)
        finally:
            for name in names:
                self.__dict__.pop(name, None)


class ReplicatedGradSum(ParallelStyle):
    """The ``replicated_grad_sum`` style: parameters whole, gradients summed over the TP ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.__dict__["_mp_grad_sum_mesh"] = device_mesh
        return with_forward(module, _GradSumForward)


def _rows(weight_rows: int, kv_heads: int, heads: list[int]) -> slice | torch.Tensor:
    """The weight rows of ``heads`` (a slice when they are consecutive, else an index)."""
    size = weight_rows // kv_heads
    if heads == list(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0] * size, (heads[-1] + 1) * size)
    return torch.tensor([h * size + i for h in heads for i in range(size)])


def _select(t: torch.Tensor, rows) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows.to(t.device))


class KVReplicatedLinear:
    """Forward of a key/value ``nn.Linear`` whose weight is whole on every rank: this rank's KV
    heads' rows, the weight (and bias) through ``f`` so shared heads sum their gradients."""

    def forward(self, x):
        mesh, rows = self.weight.device_mesh, self.__dict__["_mp_kv_rows"]
        if isinstance(rows, torch.Tensor) and rows.device != self.weight.device:  # made before the move to the GPU
            rows = self.__dict__["_mp_kv_rows"] = rows.to(self.weight.device)
        weight = _select(copy_to_tp(self.weight.to_local(), mesh), rows)
        bias = None if self.bias is None else _select(copy_to_tp(self.bias.to_local(), mesh), rows)
        return F.linear(column_input(self, x), weight, bias)


class KVReplicated(ParallelStyle):
    """The ``kv_replicated`` style for a key or value ``nn.Linear`` of ``kv_heads`` heads, under
    ``heads`` query heads: weight and bias replicated, forward computing this rank's KV heads."""

    src_data_rank = None

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"kv_replicated shards nn.Linear, not {type(module).__name__}")
        mine, _ = heads_for_rank(self.heads, self.kv_heads, device_mesh.size(), device_mesh.get_local_rank())
        module.__dict__["_mp_kv_rows"] = _rows(module.out_features, self.kv_heads, mine)
        module.__dict__["_mp_kv_heads"] = tuple(mine)
        _distribute(module, "weight", [Replicate()], device_mesh, self.src_data_rank)
        _distribute(module, "bias", [Replicate()], device_mesh, self.src_data_rank)
        return with_forward(module, KVReplicatedLinear)
