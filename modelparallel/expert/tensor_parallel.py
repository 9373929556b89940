"""Expert tensor parallelism: each expert's weights split over the tensor-parallel ranks.

Without it every rank of a tensor-parallel group holds its experts whole (the group's ranks hold
the same tokens at the MoE layer, so they compute the same thing). With it (the
``expert_tensor_parallel`` key) each expert is a Megatron MLP over the ``tp`` ranks:

- ``gate_up_proj [E, 2I, H]`` is column parallel: ``Shard(1)``, rank r holds the fused rows
  ``[r 2I/tp, (r + 1) 2I/tp)``;
- ``down_proj [E, H, I]`` is row parallel: ``Shard(2)``, rank r holds the columns of the
  intermediate features ``[r I/tp, (r + 1) I/tp)``;
- the partial outputs are summed over the ranks once per layer, after the router weights are
  applied (Megatron's ``g``); the layer's inputs (hidden states, router weights) go through ``f``,
  so their gradients, partial per rank, are summed.

The stored tensors are Hugging Face's, split by plain ``Shard`` placements, so every state dict,
checkpoint and loader sees the same global ``[E, 2I, H]`` at any degree. The price of that: HF
fuses ``[gate | up]`` on dim 1, so a contiguous row block holds gate rows of some features and up
rows of others (at tp 2, rank 0 all of gate, rank 1 all of up). The gated activation needs a
feature's gate and up on one rank, so one all-to-all over ``tp`` (``pair_gate_up``) moves each
rank's projected features to the rank whose ``down_proj`` columns they feed: the fused product
``[n, 2I/tp]`` in, ``[gate_r | up_r]`` (features ``[r I/tp, (r + 1) I/tp)``) out, backward the
reverse all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .dispatch import _AllToAll


def _pieces(rank: int, size: int) -> list[tuple[int, int]]:
    """(destination rank, position in this rank's block) of the two I/tp-wide pieces of this
    rank's fused rows, ordered by destination. Piece q of the 2 tp pieces of ``[gate | up]`` is
    gate features of rank q (q < tp) or up features of rank q - tp."""
    return sorted(((q if q < size else q - size), q - 2 * rank) for q in (2 * rank, 2 * rank + 1))


def _split_sizes(rank: int, size: int, width: int) -> tuple[list[int], list[int]]:
    """(send, recv) row counts per rank of the pairing all-to-all, ``width`` = I/tp rows a piece
    (the products travel transposed: one row per feature)."""
    send, recv = [0] * size, [0] * size
    for dest, _ in _pieces(rank, size):
        send[dest] += width
    for q in (rank, size + rank):  # this rank's gate piece, then its up piece
        recv[q // 2] += width
    return send, recv


def pair_gate_up(h: torch.Tensor, group) -> torch.Tensor:
    """This rank's fused products ``h [n, 2I/tp]`` (its rows of ``gate_up_proj``) -> ``[n, 2I/tp]``
    = ``[gate | up]`` of the features whose ``down_proj`` columns it holds. Every rank of
    ``group`` holds the same ``n`` rows (the same tokens)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    width = h.shape[1] // 2
    send, recv = _split_sizes(rank, size, width)
    rows = torch.cat([h[:, pos * width:(pos + 1) * width].t() for _, pos in _pieces(rank, size)])
    # arrivals come in source-rank order: the gate piece's holder (rank // 2) before the up piece's
    return _AllToAll.apply(rows, send, recv, group).t()


def expert_ffn_tensor_parallel(module: nn.Module, rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
                               down: torch.Tensor, group) -> torch.Tensor:
    """``dispatch.expert_ffn`` with each expert split over ``group``: ``gate_up [n_local, 2I/tp,
    H]`` (this rank's fused rows), ``down [n_local, H, I/tp]``; returns this rank's partial
    outputs ``[rows, H]`` (their sum over ``group`` is the experts' output). Every local expert
    runs, an empty one too, as in ``expert_ffn``."""
    parts = rows.split(counts)
    fused = [F.linear(x, gate_up[j]) for j, x in enumerate(parts)]
    h = torch.cat(fused) if fused else rows.new_empty((0, gate_up.shape[1]))
    act = module._apply_gate(pair_gate_up(h, group))
    outs = [F.linear(x, down[j]) for j, x in enumerate(act.split(counts))]
    return torch.cat(outs) if outs else rows.new_empty((0, down.shape[1]))
