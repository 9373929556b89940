"""Attention between one chunk of queries and one chunk of keys, and the fp32 merge of the parts.

Context parallelism computes a rank's attention output as a sum over key chunks that arrive one
at a time. Each (query chunk, key chunk) pair is a block whose softmax is normalized on its own;
``Merger`` combines the blocks' outputs by their log-sum-exp in fp32 (the online softmax of
Milakov & Gimelshein 2018, as FlashAttention and ring attention use it). The backward of a block,
given the *merged* output and log-sum-exp, is exactly that block's share of the gradient
(FlashAttention's backward recomputes ``exp(scores - lse)`` from them), so blocks are
differentiated one at a time too and nothing quadratic in the sequence is kept.

Which pairs are computed depends only on the chunks' global positions: a key chunk after the
query chunk is skipped, the same chunk is causal, an earlier one is fully visible; a sliding
window (Mistral, GPT-Neo's local layers: position q sees k when 0 <= q - k < window) can turn a
pair into an explicit mask or skip it. Bidirectional attention (encoders) sees every pair whole.
Padding (a [B, S] key mask, False for a padding token) turns a block into an explicit [B, 1, n, m]
mask: the block's own pattern and the key chunk's padding. A query row that sees no key in a
block gets output 0 and log-sum-exp -inf there; one that sees no key anywhere (a left-padding
token under causal attention) keeps output 0, as PyTorch's scaled-dot-product attention gives it.

Kernels: PyTorch's fused CPU attention (``compat.flash_attention_cpu``, which returns the
log-sum-exp and has a matching backward) on CPU; elsewhere an fp32 matrix form with the same
contract (correct on any device, not fast).
"""

from __future__ import annotations

from enum import Enum

import torch

from ..compat import flash_attention_cpu, flash_attention_cpu_backward


class Kind(Enum):
    """How much of a (query chunk, key chunk) block attends."""

    NONE = "none"      # every key is after every query (or outside the window): skipped
    FULL = "full"      # every query sees every key
    CAUSAL = "causal"  # the same chunk: query i sees keys 0..i
    MASKED = "masked"  # a sliding window cuts through the block: an explicit mask


def pair_kind(q_chunk: int, k_chunk: int, length: int, window: int | None, causal: bool = True) -> Kind:
    """The ``Kind`` of query chunk ``q_chunk`` against key chunk ``k_chunk`` (chunks of
    ``length`` tokens, in global chunk order), under causal attention limited to ``window``
    (``causal`` False: bidirectional, every pair whole)."""
    if not causal:
        return Kind.FULL
    if k_chunk > q_chunk:
        return Kind.NONE
    if q_chunk == k_chunk:
        return Kind.CAUSAL if window is None or window >= length else Kind.MASKED
    if window is None:
        return Kind.FULL
    nearest = (q_chunk - k_chunk - 1) * length + 1  # smallest q - k over the block
    farthest = (q_chunk - k_chunk + 1) * length - 1
    if nearest >= window:
        return Kind.NONE
    return Kind.FULL if farthest < window else Kind.MASKED


def window_mask(q_chunk: int, k_chunk: int, length: int, window: int, device=None) -> torch.Tensor:
    """[length, length] bool: True where query i of ``q_chunk`` sees key j of ``k_chunk``."""
    i = torch.arange(length, device=device).unsqueeze(1)
    j = torch.arange(length, device=device).unsqueeze(0)
    distance = (q_chunk - k_chunk) * length + i - j
    return (distance >= 0) & (distance < window)


def block_mask(kind: Kind, q_chunk: int, k_chunk: int, length: int, window: int | None,
               keys: torch.Tensor | None, device=None) -> tuple[Kind, torch.Tensor | None]:
    """The (kind, mask) a block is computed with: ``window_mask`` for ``Kind.MASKED``; with
    ``keys`` ([B, length] bool, the key chunk's tokens, False for padding) a [B, 1, n, m] mask
    of the block's pattern and the padding, and kind ``Kind.MASKED``."""
    mask = window_mask(q_chunk, k_chunk, length, window, device) if kind is Kind.MASKED else None
    if keys is None:
        return kind, mask
    if kind is Kind.CAUSAL:
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    padded = keys[:, None, None, :].expand(-1, -1, length, -1)
    return Kind.MASKED, padded if mask is None else padded & mask


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _scores(q, k, causal, mask, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (query head h reads kv head h // groups)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _math_forward(q, k, v, causal, mask, scale, drop=None):
    s = _scores(q, _repeat_kv(k, q.shape[1]), causal, mask, scale)
    lse = torch.logsumexp(s, dim=-1)  # of the undropped scores: the merge's weights
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
    if drop is not None:
        p = p * drop
    return torch.matmul(p, _repeat_kv(v, q.shape[1]).float()).to(q.dtype), lse


def _grouped(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, n, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def _math_backward(dout, q, k, v, out, lse, causal, mask, scale, drop=None):
    """With dropout (``drop``: the kept probabilities' scale, 0 where dropped) the gradient of a
    probability is dropout's too, and the row term stays dout . out of the dropped output."""
    kr, vr = _repeat_kv(k, q.shape[1]).float(), _repeat_kv(v, q.shape[1]).float()
    p = torch.exp(_scores(q, kr, causal, mask, scale) - lse.unsqueeze(-1))
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2) if drop is None else (p * drop).transpose(-1, -2), dout)
    dp = torch.matmul(dout, vr.transpose(-1, -2))
    if drop is not None:
        dp = dp * drop
    ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, _grouped(dk, k.shape[1]), _grouped(dv, k.shape[1])


def _fused(q: torch.Tensor, fused: bool | None) -> bool:
    return q.device.type == "cpu" if fused is None else fused


def block_forward(q, k, v, kind: Kind, mask: torch.Tensor | None, scale: float, fused: bool | None = None,
                  drop: torch.Tensor | None = None):
    """(output in ``q``'s dtype, fp32 log-sum-exp) of queries ``q`` [B, H, n, D] over keys and
    values [B, H_kv, m, D] (H a multiple of H_kv), for a block of ``kind`` (``mask``: [n, m]
    bool for ``Kind.MASKED``). A query row that sees no key gets output 0 and lse -inf.
    ``fused``: the fused CPU kernel (default on CPU) or the matrix form; ``drop`` ([B, H, n, m],
    ``dropout.keep_scale``) applies attention dropout, in the matrix form (the fused kernel draws
    its own masks, which backward could not recompute)."""
    causal = kind is Kind.CAUSAL
    if drop is not None or not _fused(q, fused):
        return _math_forward(q, k, v, causal, mask, scale, drop)
    out, lse = flash_attention_cpu(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal,
                                   attn_mask=_additive(mask, q.dtype), scale=scale)
    if mask is not None:  # the kernel reports lse 0 for a row that sees nothing
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def block_backward(dout, q, k, v, out, lse, kind: Kind, mask: torch.Tensor | None, scale: float,
                   fused: bool | None = None, drop: torch.Tensor | None = None):
    """fp32 gradients (dq, dk, dv) of one block, given the merged ``out`` (``q``'s dtype) and
    ``lse`` of its query rows: the block's share of the full attention's gradient (``drop``: the
    forward's dropout, recomputed)."""
    causal = kind is Kind.CAUSAL
    if drop is not None or not _fused(q, fused):
        return _math_backward(dout, q, k, v, out, lse, causal, mask, scale, drop)
    grads = flash_attention_cpu_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                         out.contiguous(), lse.contiguous(), 0.0, causal,
                                         attn_mask=_additive(mask, q.dtype), scale=scale)
    return tuple(g.float() for g in grads)


class Merger:
    """The running fp32 output and log-sum-exp of ``rows`` query rows, blocks merged in."""

    def __init__(self, shape: tuple[int, ...], device):
        """``shape``: the output's, [B, H, rows, D]."""
        self.out = torch.zeros(shape, dtype=torch.float32, device=device)
        self.lse = torch.full(shape[:-1], float("-inf"), dtype=torch.float32, device=device)

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge one block's (``out``, ``lse``) into query rows ``rows``."""
        old = self.lse[..., rows]
        new = torch.logaddexp(old, lse)
        pivot = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # both -inf: weights 0, not nan
        acc = self.out[..., rows, :]
        acc.mul_(torch.exp(old - pivot).unsqueeze(-1))
        acc.add_(out.float() * torch.exp(lse - pivot).unsqueeze(-1))
        self.lse[..., rows] = new
