"""Corpus reading and seeded training windows for ``train`` (the files and the byte tokenizer are
``corpus``'s, kept free of torch for the launcher; their names are here too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .corpus import (  # noqa: F401 - this module's names too
    SKIP_DIRS, TEXT_SUFFIXES, ByteTokenizer, default_data_path, find_text_files, select_files,
)


def encode_to_tensor(tokenizer, text: str) -> torch.Tensor:
    """int32 ids of ``text`` with no special tokens added. Bytes go straight through a buffer:
    a Python list of ints costs ~30x the memory of the text and megabytes of text are common."""
    if isinstance(tokenizer, ByteTokenizer):
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int32)
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.int32)


def read_corpus(files: Sequence[Path], tokenizer, max_bytes: int | None = None) -> tuple[torch.Tensor, int]:
    """(token ids of ``files`` concatenated, each followed by the end-of-text id if the tokenizer
    has one; number of files read). Stops once ``max_bytes`` of text are read. Undecodable bytes
    are replaced rather than aborting the run on one odd file."""
    eos = getattr(tokenizer, "eos_token_id", None)
    sep = torch.tensor([eos] if eos is not None else [], dtype=torch.int32)
    parts: list[torch.Tensor] = []
    total = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if not text:
            continue  # empty __init__.py files: nothing to learn, and no document to separate
        parts += [encode_to_tensor(tokenizer, text), sep]
        total += len(text.encode("utf-8"))
        if max_bytes and total >= max_bytes:
            break
    return torch.cat(parts), len(parts) // 2


def split_holdout(tokens: torch.Tensor, val_fraction: float, min_val: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last ``val_fraction`` of the stream (at least ``min_val`` tokens) is held
    out. Files were shuffled before concatenation, so the tail is a random set of files."""
    n_val = max(int(len(tokens) * val_fraction), min_val)
    if len(tokens) - n_val < min_val:
        raise ValueError(f"corpus too small: {len(tokens)} tokens, need at least {2 * min_val} "
                         "(add --data files, raise --max-files/--max-bytes or lower --seq-len)")
    return tokens[:-n_val], tokens[-n_val:]


@dataclass
class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens: inputs are the first ``seq_len``, targets the last.

    Each step draws one global batch of ``batch_size x dp_size`` windows from a generator seeded
    by ``seed`` alone, and data-parallel rank r takes its rows ``[r x batch_size, (r+1) x
    batch_size)``. So the tensor-parallel (and pipeline, context) ranks of one replica get
    identical batches (they hold parts of one model), different replicas get different rows, and
    a run at any layout trains on the same global batches as one process given
    ``--batch-size batch_size x dp_size``: the layouts train to the same losses.
    """

    tokens: torch.Tensor
    seq_len: int
    batch_size: int
    seed: int
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        if len(self.tokens) <= self.seq_len + 1:
            raise ValueError(f"{len(self.tokens)} training tokens is too few for --seq-len {self.seq_len}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} is not one of the {self.dp_size} data-parallel ranks")
        self._gen = torch.Generator().manual_seed(self.seed * 1_000_003)

    def _starts(self) -> list[int]:
        """This rank's rows of the next global batch's window starts."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size * self.dp_size,),
                               generator=self._gen)
        return starts[self.dp_rank * self.batch_size:(self.dp_rank + 1) * self.batch_size].tolist()

    def skip(self, batches: int) -> None:
        """Draw and discard ``batches`` batches, so a resumed run sees the data an uninterrupted
        run would have seen next."""
        for _ in range(batches):
            self._starts()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch_size, seq_len]; targets are inputs shifted by one."""
        windows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in self._starts()])
        return windows[:, :-1].long(), windows[:, 1:].long()


def eval_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, max_windows: int,
                 dp_rank: int = 0, dp_size: int = 1):
    """Consecutive non-overlapping windows of the held-out stream, dealt round-robin to
    data-parallel ranks (the same ones on every TP rank of a group), in (inputs, targets)
    batches. Deterministic, so validation losses of different runs are comparable."""
    n = min((len(tokens) - 1) // seq_len, max_windows)
    mine = list(range(dp_rank, n, dp_size))
    for b in range(0, len(mine), batch_size):
        w = torch.stack([tokens[i * seq_len:(i + 1) * seq_len + 1] for i in mine[b:b + batch_size]])
        yield w[:, :-1].long(), w[:, 1:].long()
