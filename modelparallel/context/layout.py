"""Where each context-parallel rank's tokens sit in the whole sequence (the load-balanced split).

Under causal attention a query attends to the keys before it, so cutting a sequence into C
contiguous pieces would give the last rank C times the work of the first. Instead the sequence
is cut into 2C equal chunks and rank r holds chunks r and 2C-1-r, concatenated: every rank then
has one early and one late chunk and the same amount of attention work (Megatron-LM's context
parallelism and SageMaker v2's scripts split this way). With C = 2 and a sequence of 8 tokens,
rank 0 holds tokens 0 1 6 7 and rank 1 holds 2 3 4 5.

Everything here is index arithmetic on one rank's view; no communication.
"""

from __future__ import annotations

import torch


def chunks_of(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices (of 2 x ``cp_size``) that rank ``cp_rank`` holds, in its order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_split(length: int, cp_size: int, what: str = "sequence length") -> None:
    """Raise unless a sequence of ``length`` tokens splits into 2 x ``cp_size`` equal chunks.

    Raises:
        ValueError: naming the length and the chunk count.
    """
    if length % (2 * cp_size):
        raise ValueError(f"{what} {length} is not divisible by 2 x context_parallel_degree = {2 * cp_size} "
                         f"(each of the {cp_size} context-parallel ranks holds two equal chunks)")


def split(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """Rank ``cp_rank``'s part of ``tensor`` (the whole sequence along ``seq_dim``): chunks r and
    2C-1-r of 2C, concatenated (a new tensor).

    Raises:
        ValueError: the sequence does not divide into 2C equal chunks.
    """
    if cp_size == 1:
        return tensor
    check_split(tensor.shape[seq_dim], cp_size)
    pieces = tensor.chunk(2 * cp_size, dim=seq_dim)
    first, second = chunks_of(cp_rank, cp_size)
    return torch.cat([pieces[first], pieces[second]], dim=seq_dim)


def merge(parts: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` from rank r): ``split``'s inverse."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    ordered: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = chunks_of(rank, cp_size)
        ordered[first], ordered[second] = part.chunk(2, dim=seq_dim)
    return torch.cat(ordered, dim=seq_dim)


def positions(local_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions (0-based) of rank ``cp_rank``'s ``local_length`` tokens, in its order."""
    half = local_length // 2
    first, second = chunks_of(cp_rank, cp_size)
    base = torch.arange(half, device=device)
    return torch.cat([base + first * half, base + second * half])
