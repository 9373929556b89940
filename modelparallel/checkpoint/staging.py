"""All-or-nothing loads: read into staging tensors, swap into the live ones only when every rank
has read and verified everything.

A load that writes into the model as it reads can fail half-way (a file truncated or flipped
after an earlier check, an I/O error, a peer dying): the model is then half old, half new, and
TP ranks disagree. So every load reads into new tensors shaped and placed like the live ones
(``stage``); only after the read phase ended without error on every rank are the values copied
in (``ModelLoad.apply``), which allocates nothing and cannot fail half-way for I/O reasons.

The price is memory: one staged copy of what this rank loads (its shards of the loaded
parameters and buffers), held from the read until the swap; ``ModelLoad.nbytes`` says how much.
The optimizer part needs no second copy of the same kind: its state is read into new tensors
that replace the old state when applied, so the old state is freed then. A resume armed before
the optimizer exists keeps the model's previous values in the staging tensors
(``apply(keep_old=True)``) until the optimizer part is applied, so a refused optimizer part can
put the model back (``restore``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from ..materialize.state_dict import LoadReport
from ..tp.layout import from_local_like, local_part


def like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor of ``t``'s shape, dtype, device and (for a DTensor) placement."""
    if isinstance(t, DTensor):
        local = t.to_local()
        return from_local_like(torch.empty(local.shape, dtype=local.dtype, device=local.device), t)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def stage(live: dict[str, torch.Tensor], keys) -> dict[str, torch.Tensor]:
    """New tensors like ``live[k]`` for every ``k`` in ``keys``."""
    return {k: like(live[k]) for k in sorted(keys)}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes this rank holds for ``tensors`` (local shards)."""
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors.values())


@dataclass
class ModelLoad:
    """A model load read and verified into ``staged``; ``apply`` makes it live."""

    report: LoadReport
    live: dict[str, torch.Tensor]
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    swapped: bool = False

    @property
    def nbytes(self) -> int:
        return nbytes(self.staged)

    def apply(self, keep_old: bool = False) -> None:
        """Copy the staged values into the live tensors. ``keep_old``: exchange them instead,
        so ``restore`` can put the previous values back (one tensor of scratch at a time)."""
        with torch.no_grad():
            for key, new in self.staged.items():
                dst, src = local_part(self.live[key]), local_part(new)
                if keep_old:
                    old = dst.clone()
                    dst.copy_(src)
                    src.copy_(old)
                else:
                    dst.copy_(src)
        self.swapped = keep_old
        if not keep_old:
            self.staged = {}

    def restore(self) -> None:
        """Undo ``apply(keep_old=True)``."""
        if self.swapped:
            with torch.no_grad():
                for key, old in self.staged.items():
                    local_part(self.live[key]).copy_(local_part(old))
        self.staged, self.swapped = {}, False

    def release(self) -> None:
        """Forget the previous values (the load is final)."""
        self.staged, self.swapped = {}, False
