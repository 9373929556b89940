"""Attention over a sequence split across the context-parallel ranks (causal or bidirectional,
with padding).

Each rank holds the queries, keys and values of its two chunks (``layout``). Its output needs the
keys and values of every earlier chunk, so they travel:

- ``p2p`` (ring attention, Liu et al. 2023): keys and values go round the ring of ranks, one
  rank's block per step; the transfer of the next block is started before the current block is
  computed, so communication overlaps compute. Backward sends the blocks round again; the other
  ranks' shares of a block's gradient accumulate as they travel until they reach its owner (C-1
  hops: the owner's own share stays where it is).
- ``all_gather``: every rank's keys and values are gathered once per layer (started before the
  local block is computed, waited for after it); backward gathers them again and returns each
  rank's key/value gradients by one reduce-scatter (Llama 3's context parallelism).

Padding travels as the whole sequences' [B, S] key mask, which every rank holds (``inputs``
gathers it once per forward: S booleans a row, against the keys and values' S x H x D numbers),
so each block masks its key chunk's padding without another message. Attention dropout drops
each block's probabilities with a mask recomputed in backward from its seed (``dropout``).

Either way each rank computes only its own queries' blocks, merged in fp32 by their log-sum-exp
(``blocks``), and keeps for backward only its queries, keys, values, output and log-sum-exp: no
block of scores is stored, and gathered keys and values are freed after each use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compat import all_gather_single, reduce_scatter_single
from .blocks import Kind, Merger, block_backward, block_forward, block_mask, pair_kind
from .dropout import draw_seed, keep_scale
from .layout import chunks_of

COMM_TYPES = ("p2p", "all_gather")


@dataclass(frozen=True)
class Ring:
    """The context-parallel group as attention sees it."""

    group: dist.ProcessGroup
    rank: int
    size: int
    comm: str

    def peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places after this one."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)


@dataclass(frozen=True)
class Pattern:
    """Which keys a query sees: ``causal`` (else bidirectional), a sliding ``window`` (causal
    only; None: none), ``keys`` the whole sequences' [B, S] bool key mask in global order (False:
    padding; None: no padding); and attention ``dropout`` with the ``seed`` of its mask."""

    causal: bool = True
    window: int | None = None
    keys: torch.Tensor | None = None
    dropout: float = 0.0
    seed: int = 0


def _drop(pattern: Pattern, ring: Ring, q, x: int, y: int, length: int):
    """The dropout scale of block (query chunk ``x``, key chunk ``y``), or None without dropout."""
    if pattern.dropout == 0:
        return None
    base = torch.arange(length, device=q.device)
    return keep_scale(pattern.seed, pattern.dropout, q.shape[0], q.shape[1], base + x * length, base + y * length,
                      2 * ring.size * length)


def _pairs(ring: Ring, source: int, length: int, pattern: Pattern, device):
    """(query rows, key rows, kind, mask, query chunk, key chunk) of every block this rank
    computes against ``source``'s keys (``length`` tokens per chunk, rows local to each side)."""
    for xi, x in enumerate(chunks_of(ring.rank, ring.size)):
        for yi, y in enumerate(chunks_of(source, ring.size)):
            kind = pair_kind(x, y, length, pattern.window, pattern.causal)
            if kind is Kind.NONE:
                continue
            keys = None if pattern.keys is None else pattern.keys[:, y * length:(y + 1) * length]
            kind, mask = block_mask(kind, x, y, length, pattern.window, keys, device)
            yield slice(xi * length, (xi + 1) * length), slice(yi * length, (yi + 1) * length), kind, mask, x, y


def _forward_source(merger: Merger, q, kv, split: int, ring: Ring, source: int, pattern, scale) -> None:
    k, v = kv[..., :split], kv[..., split:]
    length = q.shape[2] // 2
    for rows, cols, kind, mask, x, y in _pairs(ring, source, length, pattern, q.device):
        out, lse = block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], kind, mask, scale,
                                 drop=_drop(pattern, ring, q, x, y, length))
        merger.add(rows, out, lse)


def _backward_source(dq, dkv, dout, q, kv, split, out, lse, ring: Ring, source: int, pattern, scale) -> None:
    """Add the gradients of this rank's blocks against ``source``'s keys and values: into ``dq``
    (this rank's queries) and ``dkv`` (``source``'s keys | values, fp32)."""
    k, v = kv[..., :split], kv[..., split:]
    length = q.shape[2] // 2
    for rows, cols, kind, mask, x, y in _pairs(ring, source, length, pattern, q.device):
        gq, gk, gv = block_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                    out[:, :, rows], lse[:, :, rows], kind, mask, scale,
                                    drop=_drop(pattern, ring, q, x, y, length))
        dq[:, :, rows] += gq
        dkv[:, :, cols, :split] += gk
        dkv[:, :, cols, split:] += gv


def _exchange(ring: Ring, tensor: torch.Tensor) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Start sending ``tensor`` to the next rank and receiving the previous rank's into a new one;
    (works, received, sent): the sent tensor is kept referenced until the works are waited for."""
    incoming = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, ring.peer(1), ring.group),
           dist.P2POp(dist.irecv, incoming, ring.peer(-1), ring.group)]
    return dist.batch_isend_irecv(ops), incoming, tensor


def _wait(transfer) -> torch.Tensor:
    """Wait for a transfer started by ``_exchange``; the received tensor."""
    for work in transfer[0]:
        work.wait()
    return transfer[1]


def _ring_forward(ring: Ring, q, kv, split, pattern, scale):
    merger = Merger(q.shape[:-1] + (kv.shape[-1] - split,), q.device)
    current = kv
    for step in range(ring.size):
        pending = _exchange(ring, current) if step < ring.size - 1 else None
        _forward_source(merger, q, current, split, ring, (ring.rank - step) % ring.size, pattern, scale)
        if pending is not None:
            current = _wait(pending)
    return merger


def _ring_backward(ring: Ring, dout, q, kv, split, out, lse, pattern, scale):
    """The owner keeps its own queries' share of its key/value gradient; the other ranks' shares
    accumulate along the ring from the next rank on and reach the owner on the (C-1)th hop."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    current, own, travelling = kv, None, None  # travelling: the gradient sum of the block held now
    for step in range(ring.size):
        pending = _exchange(ring, current) if step < ring.size - 1 else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        _backward_source(dq, dkv, dout, q, current, split, out, lse, ring, (ring.rank - step) % ring.size,
                         pattern, scale)
        if step == 0:
            own = dkv
        else:
            if travelling is not None:
                dkv += _wait(travelling)
            travelling = _exchange(ring, dkv)  # on to the next rank; the last hop reaches the owner
        if pending is not None:
            current = _wait(pending)
    return dq, own if travelling is None else own + _wait(travelling)


def _gather(ring: Ring, kv):
    """Start gathering every rank's keys | values: (work, [C, B, H_kv, L, D] once waited for)."""
    everyone = kv.new_empty((ring.size * kv.shape[0],) + kv.shape[1:])
    work = all_gather_single(everyone, kv.contiguous(), group=ring.group, async_op=True)
    return work, everyone.view((ring.size,) + kv.shape)


def _gather_forward(ring: Ring, q, kv, split, pattern, scale):
    merger = Merger(q.shape[:-1] + (kv.shape[-1] - split,), q.device)
    work, everyone = _gather(ring, kv)
    _forward_source(merger, q, kv, split, ring, ring.rank, pattern, scale)
    work.wait()
    for source in range(ring.size):
        if source != ring.rank:
            _forward_source(merger, q, everyone[source], split, ring, source, pattern, scale)
    return merger


def _gather_backward(ring: Ring, dout, q, kv, split, out, lse, pattern, scale):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((ring.size,) + kv.shape, dtype=torch.float32, device=kv.device)
    work, everyone = _gather(ring, kv)
    _backward_source(dq, dkv[ring.rank], dout, q, kv, split, out, lse, ring, ring.rank, pattern, scale)
    work.wait()
    for source in range(ring.size):
        if source != ring.rank:
            _backward_source(dq, dkv[source], dout, q, everyone[source], split, out, lse, ring, source, pattern, scale)
    mine = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
    reduce_scatter_single(mine, dkv.view((-1,) + kv.shape[1:]), group=ring.group)  # my keys' shares, summed
    return dq, mine


class _ContextAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys and values (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, pattern, scale):
        kv = torch.cat([k, v], dim=-1)  # one message per block: [B, H_kv, L, Dk + Dv]
        split = k.shape[-1]
        run = _ring_forward if ring.comm == "p2p" else _gather_forward
        merger = run(ring, q, kv, split, pattern, scale)
        out = merger.out.to(q.dtype)
        # a row that sees no key anywhere (lse -inf) gets lse 0 for backward: its scores are all
        # -inf, so exp(scores - 0) is 0 and the row has no gradient, where -inf would give nan
        lse = merger.lse.masked_fill(torch.isneginf(merger.lse), 0.0)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.ring, ctx.split, ctx.pattern, ctx.scale = ring, split, pattern, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        run = _ring_backward if ctx.ring.comm == "p2p" else _gather_backward
        dq, dkv = run(ctx.ring, dout.contiguous(), q, kv, ctx.split, out, lse, ctx.pattern, ctx.scale)
        dk, dv = dkv[..., :ctx.split], dkv[..., ctx.split:]
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None, None, None


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float,
                      window: int | None = None, *, causal: bool = True,
                      keys: torch.Tensor | None = None, dropout: float = 0.0,
                      seed: int | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence.

    Args:
        q: [B, H, L, D] this rank's queries (its two chunks, ``layout``'s order).
        k, v: [B, H_kv, L, D] its keys and values (H a multiple of H_kv: grouped-query attention).
        ring: the context-parallel group and the communication (``COMM_TYPES``).
        scale: the factor on ``q . k``.
        window: a sliding window (query position p sees keys p - window + 1 .. p), or None.
        causal: causal (a decoder) or bidirectional (an encoder) attention.
        keys: the whole sequences' [B, S] bool key mask in global order (False: padding), or None.
        dropout: attention dropout probability (``dropout``'s mask, the same for any layout).
        seed: the dropout mask's seed; None: drawn from PyTorch's default generator.

    Returns:
        [B, H, L, D] in ``q``'s dtype.

    Raises:
        NotImplementedError: a sliding window on bidirectional attention.
    """
    if window is not None and not causal:
        raise NotImplementedError("a sliding window on bidirectional attention under context parallelism")
    if dropout and seed is None:
        seed = draw_seed()
    return _ContextAttention.apply(q, k, v, ring, Pattern(causal, window, keys, dropout, seed or 0), scale)
