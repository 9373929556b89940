"""Full checkpoints saved asynchronously: gather in the call, write in the background.

A full checkpoint (a Hugging Face directory or SageMaker's single file) is written by rank 0
alone, from tensors gathered over the training's groups. The gather is a collective on those
groups, so it stays in the call; what rank 0 receives is already its own host copy, which
``Collected`` keeps (copying the few tensors that still share memory with the model). The
write, fsync and commit then run in ``async_save.AsyncSaver``'s thread as one phase agreed on
its own process group: ``newest`` moves only once the checkpoint is durable, a failure is
raised on every rank by the next wait, one save is in flight, the exit waits for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...tp.layout import local_part
from ..safety import commit
from ..safety.errors import run_phase


class Collected:
    """What ``stream`` hands rank 0 in an asynchronous save: every translated tensor in write
    order, each owned by the save (one still sharing memory with the model, e.g. a replicated
    weight, is copied), so training may change the model while the background writes."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.live = {local_part(t).untyped_storage().data_ptr() for t in state.values()}
        self.items: list[tuple[str, torch.Tensor]] = []

    def write(self, key: str, tensor: torch.Tensor) -> None:
        t = tensor.detach()
        self.items.append((key, (t.clone() if t.untyped_storage().data_ptr() in self.live else t).cpu()))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.items)


def raise_error(error: Exception | None) -> None:
    if error is not None:
        raise error


def drain(items: list) -> Any:
    """The items, each dropped from ``items`` as it is taken (rank 0 frees each once written)."""
    while items:
        yield items.pop(0)


def in_background(saver, tag: str, path: Path, write) -> None:
    """Run ``write`` (rank 0's write, fsync and commit) in ``saver``'s thread as a phase agreed on
    its process group; a failure anywhere cleans the leftovers and is raised on every rank by the
    next wait."""
    group = saver.process_group()
    rank = dist.get_rank() if dist.is_initialized() else 0

    def run():
        try:
            run_phase("full save (write)", write, group)
        except Exception:
            if rank == 0:
                commit.clean_leftovers(path)
            raise

    saver.submit(tag, run)
