"""Dropless token dispatch: each (token, expert) pair travels to the rank holding its expert and back.

A rank holds ``n_local`` consecutive experts of every MoE layer (rank r: experts ``r * n_local``
to ``(r + 1) * n_local - 1``). Two dispatchers, both exact (no capacity factor, no token dropped,
so the layer computes what one process computes):

- all-to-all (``dispatch_all_to_all``, GShard / Megatron-Core's default): the pairs are sorted by
  expert, so the rows bound for each rank are contiguous; one all-to-all of the per-expert counts,
  one of the token rows, the experts' feed-forward, one all-to-all back. Forward traffic per layer
  and rank: 2 x tokens x top_k x hidden values.
- all-gather (``dispatch_all_gather``): every rank gathers all tokens of the group (and their
  routing), computes its own experts' share of every token, and a reduce-scatter sums the shares
  back to the tokens' ranks.

The first exchange of each dispatch (the per-expert counts, or the token counts) also carries
every rank's verdict on its own routing (expert indices in range, shapes that agree), so a rank
whose input is bad raises its error and every other rank raises naming it, at the same point,
instead of waiting in the next collective.

Both combine like Hugging Face's experts module: each expert output is multiplied by its router
weight in the weight's dtype, cast back, and added into zeros in ascending expert order. The
backward of each collective is the reverse collective, written as autograd functions over c10d's
public calls (visible to ``CommDebugMode``), so every rank runs the same collectives in the same
order forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..compat import all_gather_single, reduce_scatter_single


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` sent to the group's ranks, ``send[i]`` rows to rank i, ``recv[i]`` rows
    received from it; backward sends the gradient rows back where they came from."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllGather(torch.autograd.Function):
    """Every rank's ``x`` concatenated in rank order; backward sums the gradients over the ranks
    and keeps this rank's rows (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
        all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    """The sum over the ranks of ``x``, this rank's block of rows; backward gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
        reduce_scatter_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, ctx.group), None


def expert_ffn(module: nn.Module, rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """Hugging Face's expert feed-forward on ``rows`` grouped by local expert (``counts[j]`` rows
    for expert j, ``gate_up [n_local, 2I, H]``, ``down [n_local, H, I]``): ``down(gate(act) *
    up)`` with the module's own gating. Every expert runs, an empty one too, so each local
    expert's weights get a gradient (zeros when no token chose it), as in the unsharded model."""
    outs = [F.linear(module._apply_gate(F.linear(x, gate_up[j])), down[j]) for j, x in enumerate(rows.split(counts))]
    return torch.cat(outs) if outs else rows.new_empty((0, down.shape[1]))


def _combine(like: torch.Tensor, token: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows ``y`` weighted by ``w`` and added into zeros shaped like ``like`` at rows ``token``
    (rows sorted by expert, so each token's outputs add in ascending expert order)."""
    contrib = (y * w[:, None]).to(like.dtype)
    return torch.zeros_like(like).index_add(0, token, contrib)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(perm), device=perm.device)
    return inv


class DispatchError(RuntimeError):
    """Expert dispatch refused on some rank of the group (its own error names the cause)."""


def _routing_problem(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, experts: int) -> str | None:
    """Why this rank's routing cannot be dispatched, or None."""
    if index.dim() != 2 or weights.shape != index.shape or x.dim() != 2 or x.shape[0] != index.shape[0]:
        return (f"expert dispatch expects hidden_states [T, H], top_k_index and top_k_weights [T, k]; got "
                f"{tuple(x.shape)}, {tuple(index.shape)}, {tuple(weights.shape)}")
    if index.is_floating_point() or index.is_complex():
        return f"top_k_index must hold integer expert indices, got {index.dtype}"
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= experts):
        return f"top_k_index holds experts {int(index.min())}..{int(index.max())}, outside [0, {experts})"
    return None


def _agree(problem: str | None, status: torch.Tensor, group) -> None:
    """Raise on every rank when any rank's ``status`` (received, one entry per source rank) is set:
    the rank at fault with its own ``problem``, the others naming it."""
    failed = status.nonzero().flatten().tolist()
    if problem is not None:
        raise ValueError(problem)
    if failed:
        ranks = [dist.get_global_rank(group, r) for r in failed]
        raise DispatchError(f"expert dispatch failed on rank(s) {ranks} (their error names the cause)")


def compute_local(module: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, ffn=None) -> torch.Tensor:
    """The dispatchers' result when this rank holds every expert (an expert-parallel group of
    one, under expert tensor parallelism): the same grouping by expert and combine, no exchange.
    A bad routing raises here, alike on every rank of a tensor-parallel group (they route the
    same tokens), before any collective."""
    problem = _routing_problem(x, index, weights, gate_up.shape[0])
    if problem is not None:
        raise ValueError(problem)
    order = torch.argsort(index.reshape(-1), stable=True)
    counts = torch.bincount(index.reshape(-1), minlength=gate_up.shape[0]).tolist()
    y = (ffn or expert_ffn)(module, x[order // index.shape[-1]], counts, gate_up, down)
    return _combine(x, order // index.shape[-1], y, weights.reshape(-1)[order])


def dispatch_all_to_all(module: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, group, ffn=None) -> torch.Tensor:
    """The MoE layer's output for this rank's tokens ``x [T, H]`` routed to experts ``index [T, k]``
    with ``weights [T, k]``, the experts sharded over ``group`` (this rank's: ``gate_up``,
    ``down``), by all-to-all. ``ffn``: the experts' feed-forward, ``expert_ffn``'s signature
    (default: ``expert_ffn``; expert tensor parallelism passes its own)."""
    ffn = ffn or expert_ffn
    size, n_local = dist.get_world_size(group), gate_up.shape[0]
    problem = _routing_problem(x, index, weights, size * n_local)
    flat = index.reshape(-1) if problem is None else index.new_empty(0, dtype=torch.long)
    k = index.shape[-1] if problem is None else 1
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
    token = order // k
    counts = torch.bincount(flat, minlength=size * n_local).view(size, n_local)
    verdict = torch.full((size, 1), int(problem is not None), dtype=counts.dtype, device=counts.device)
    arrived_counts = torch.empty((size, n_local + 1), dtype=counts.dtype, device=counts.device)
    dist.all_to_all_single(arrived_counts, torch.cat([counts, verdict], 1), group=group)  # [source rank, local expert]
    _agree(problem, arrived_counts[:, -1], group)
    counts, arrived_counts = counts.flatten(), arrived_counts[:, :-1]
    send, recv = counts.view(size, n_local).sum(1).tolist(), arrived_counts.sum(1).tolist()
    arrived = _AllToAll.apply(x[token], send, recv, group)
    expert_of_row = torch.arange(n_local, device=x.device).repeat(size).repeat_interleave(arrived_counts.flatten())
    by_expert = torch.argsort(expert_of_row, stable=True)
    y = ffn(module, arrived[by_expert], arrived_counts.sum(0).tolist(), gate_up, down)
    back = _AllToAll.apply(y[_inverse(by_expert)], recv, send, group)
    return _combine(x, token, back, weights.reshape(-1)[order])


def dispatch_all_gather(module: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, group, ffn=None) -> torch.Tensor:
    """The same output as ``dispatch_all_to_all``, by all-gathering every rank's tokens (padded to
    the longest rank's count) and reduce-scattering the experts' weighted outputs."""
    ffn = ffn or expert_ffn
    size, n_local, k = dist.get_world_size(group), gate_up.shape[0], index.shape[-1]
    problem = _routing_problem(x, index, weights, size * n_local)
    sizes = torch.empty((size, 2), dtype=torch.long, device=x.device)
    mine = torch.tensor([[x.shape[0], int(problem is not None)]], device=x.device)
    all_gather_single(sizes, mine, group=group)
    _agree(problem, sizes[:, 1], group)
    pad = int(sizes[:, 0].max()) - x.shape[0]
    xs = _AllGather.apply(F.pad(x, (0, 0, 0, pad)), group)
    ws = _AllGather.apply(F.pad(weights, (0, 0, 0, pad)), group)
    ids = index.new_empty((xs.shape[0], k))
    all_gather_single(ids, F.pad(index, (0, 0, 0, pad), value=-1).contiguous(), group=group)
    first = dist.get_rank(group) * n_local
    local = ((ids >= first) & (ids < first + n_local)).reshape(-1).nonzero().squeeze(1)  # mine, by (token, slot)
    expert = ids.reshape(-1)[local] - first
    order = torch.argsort(expert, stable=True)
    pairs = local[order]
    y = ffn(module, xs[pairs // k], torch.bincount(expert, minlength=n_local).tolist(), gate_up, down)
    part = _combine(xs, pairs // k, y, ws.reshape(-1)[pairs])
    return _ReduceScatter.apply(part, group)[:x.shape[0]]
