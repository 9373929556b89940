"""How far a sharded computation may be from the unsharded one: rounding only.

A tensor-parallel layer computes the same sums as the whole one, split over ranks and added in
another order. Reordering a floating-point sum of n terms changes it by about
sqrt(n) x eps x the terms' magnitude (each addition errs by at most eps/2 of its partial sum,
and the errors add like a random walk); the magnitude is taken as the largest entry of the
expected tensor, and ``DEPTH`` allows for rounding carried through the layers before it (the
proxy has two). A wrong plan (a head split, a chunk swapped, a size not made per-rank) is off
by the size of the values themselves, orders of magnitude beyond this.
"""

from __future__ import annotations

import math

import torch

DEPTH = 8


def tolerance(expected: torch.Tensor, terms: int) -> float:
    """Absolute tolerance for another evaluation of ``expected``'s computation whose longest
    reduction has ``terms`` terms."""
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    eps = torch.finfo(expected.dtype).eps
    return DEPTH * math.sqrt(max(terms, 1)) * eps * max(scale, torch.finfo(expected.dtype).tiny)


def excess(actual: torch.Tensor, expected: torch.Tensor, terms: int, extra: float = 0.0) -> tuple[float, float]:
    """(largest difference, its tolerance); the computation is exact up to rounding when the
    first is within the second. ``extra`` widens the tolerance (measured rounding noise)."""
    diff = (actual.detach().double() - expected.detach().double()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    return (worst if math.isfinite(worst) else math.inf), tolerance(expected, terms) + extra
