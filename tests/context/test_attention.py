"""Context-parallel attention (modelparallel/context/attention.py, blocks.py) equals PyTorch's
attention on the whole sequence: outputs and the gradients of queries, keys and values, for both
communication types, 2 and 4 ranks, grouped-query heads and sliding windows that cut through,
fill or skip chunk pairs.

A failure in ``test_pair_kinds`` or ``test_blocks_*`` (one process) points at blocks.py: the
classification of a (query chunk, key chunk) pair, the kernel contract or the log-sum-exp merge.
A failure only on several ranks points at attention.py's schedule: which rank's keys a step
holds (p2p), or the return of key/value gradients to their owner (the ring's travelling sum, the
all-gather's reduce-scatter).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness
from modelparallel.context import blocks
from modelparallel.context.attention import Ring, context_attention
from modelparallel.context.layout import merge, split
from reference import assert_close


def _mask(length: int, window: int | None) -> torch.Tensor:
    q = torch.arange(length).unsqueeze(1)
    k = torch.arange(length).unsqueeze(0)
    return (k <= q) & ((q - k < window) if window is not None else True)


def _reference(q, k, v, window, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(q.shape[2], window), scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def test_pair_kinds():
    """Chunk pairs against the explicit mask of the whole sequence (chunks of 4 tokens)."""
    length, n = 4, 6
    for window in (None, 1, 3, 4, 5, 8, 9, 30):
        full = _mask(length * n, window)
        for x in range(n):
            for y in range(n):
                block = full[x * length:(x + 1) * length, y * length:(y + 1) * length]
                kind = blocks.pair_kind(x, y, length, window)
                if kind is blocks.Kind.NONE:
                    assert not block.any(), (window, x, y)
                elif kind is blocks.Kind.FULL:
                    assert block.all(), (window, x, y)
                elif kind is blocks.Kind.CAUSAL:
                    assert torch.equal(block, torch.ones(length, length, dtype=torch.bool).tril()), (window, x, y)
                else:
                    assert torch.equal(block, blocks.window_mask(x, y, length, window)), (window, x, y)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_cpu_kernel", "matrix_form"])
def test_blocks_merge_to_full_attention(fused):
    """Two key halves merged by log-sum-exp, and their backward given the merged output, equal
    attention over all keys (rows that see nothing of the first half included), with the fused
    CPU kernel and with the matrix form every other device uses."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 8)
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    # queries at positions 8..15 of a 16-token sequence, window 5: the first key half is
    # partly visible (some rows see none of it), the second is the causal diagonal cut by the window
    mask = _mask(16, 5)[8:]
    parts = [(slice(0, 8), blocks.Kind.MASKED, mask[:, :8]), (slice(8, 16), blocks.Kind.MASKED, mask[:, 8:])]
    merger = blocks.Merger(q.shape, q.device)
    for cols, kind, m in parts:
        out, lse = blocks.block_forward(q, k[:, :, cols], v[:, :, cols], kind, m, 0.3, fused)
        merger.add(slice(0, 8), out, lse)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert_close(merger.out.to(q.dtype), want.to(q.dtype), "merged output", terms=16)
    dout = torch.randn_like(want)
    want.backward(dout)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    for cols, kind, m in parts:
        gq, gk, gv = blocks.block_backward(dout.to(q.dtype), q, k[:, :, cols], v[:, :, cols],
                                           merger.out.to(q.dtype), merger.lse, kind, m, 0.3, fused)
        dq += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
    for name, got, ref in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert_close(got, ref.float(), name, terms=16)


def _gathered(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return merge(parts, seq_dim=2)


def check_attention(comm: str, window, kv_heads: int, chunk: int):
    size, rank = dist.get_world_size(), dist.get_rank()
    ring = Ring(dist.group.WORLD, rank, size, comm)
    g = torch.Generator().manual_seed(7)
    length = 2 * size * chunk
    q = torch.randn(2, 4, length, 8, generator=g)
    k, v = torch.randn(2, kv_heads, length, 8, generator=g), torch.randn(2, kv_heads, length, 8, generator=g)
    dout = torch.randn(2, 4, length, 8, generator=g)
    scale = 1 / math.sqrt(8)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _reference(*full, window, scale)
    want.backward(dout)
    mine = [split(t, size, rank, seq_dim=2).requires_grad_() for t in (q, k, v)]
    out = context_attention(*mine, ring, scale, window)
    out.backward(split(dout, size, rank, seq_dim=2))
    assert_close(_gathered(out.detach()), want.detach(), f"{comm} output", terms=length)
    for name, got, ref in zip("qkv", mine, full):
        assert_close(_gathered(got.grad), ref.grad, f"{comm} d{name}", terms=length)


CASES = [  # (ranks, comm, window, kv heads, tokens per chunk)
    (2, "p2p", None, 4, 4), (2, "all_gather", None, 4, 4), (2, "p2p", None, 2, 3),
    (2, "p2p", 3, 2, 4), (2, "all_gather", 6, 2, 4), (2, "p2p", 9, 4, 4),
    (4, "p2p", None, 2, 2), (4, "all_gather", None, 2, 2), (4, "p2p", 5, 4, 2), (4, "all_gather", 3, 1, 2),
]


@pytest.mark.parametrize("world, comm, window, kv_heads, chunk", CASES)
def test_context_attention_equals_whole_sequence(world, comm, window, kv_heads, chunk):
    harness.run(world, check_attention, comm, window, kv_heads, chunk)
