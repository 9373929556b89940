"""Attention dropout under context parallelism: one mask for the whole attention matrix, drawn
block by block.

Dropout on attention probabilities multiplies each probability P[i, j] by M[i, j] / (1 - p),
M[i, j] kept (1) with probability 1 - p. Split over blocks, each block's output is normalized by
its own log-sum-exp of the *undropped* scores; the log-sum-exp merge only rescales each block
linearly, so a block may drop its probabilities before the merge and the merged output is
exactly softmax-then-dropout of the whole row (FlashAttention drops inside its tiles the same
way). Backward needs the very same M: it is not stored (that is quadratic in the sequence) but
recomputed, so M is a function of the seed and the element's global coordinates (batch row,
head, query position, key position): a counter-based hash (SplitMix64's finalizer), the same
whatever the layout, the degree or the communication type. The seed is drawn from PyTorch's
default generator once per attention call, so ``torch.manual_seed`` makes a run reproducible;
the draws cannot equal one process's ``nn.functional.dropout``, whose mask comes from another
generator, only its distribution.
"""

from __future__ import annotations

import torch

_MIX1, _MIX2 = -4658895280553007687, -7723592293110705685  # 0xbf58476d1ce4e5b9, 0x94d049bb133111eb as int64
_BITS = 24  # uniform draws in steps of 2^-24


def draw_seed() -> int:
    """A fresh seed from PyTorch's default (CPU) generator."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 (wrapping arithmetic; shifts made logical by masking)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def keep_scale(seed: int, p: float, batch: int, heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
               total: int) -> torch.Tensor:
    """[batch, heads, n, m] fp32: 1 / (1 - p) where element (b, h, q_pos[i], k_pos[j]) of the
    whole attention matrix (``total`` keys a row) is kept, 0 where dropped."""
    b = torch.arange(batch, device=q_pos.device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=q_pos.device).view(1, -1, 1, 1)
    index = ((b * heads + h) * total + q_pos.view(1, 1, -1, 1)) * total + k_pos.view(1, 1, 1, -1)
    salt = _mix(torch.tensor(seed, dtype=torch.int64, device=q_pos.device))  # seeds s, s + 1: unrelated masks
    bits = _mix(_mix(index ^ salt)) & ((1 << _BITS) - 1)
    keep = bits.to(torch.float64) >= p * (1 << _BITS)
    return keep.to(torch.float32) / (1.0 - p)
