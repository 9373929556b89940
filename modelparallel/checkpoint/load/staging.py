"""All-or-nothing loads: read into staging tensors, swap into the live ones only when every rank
has read and verified everything.

A load that writes into the model as it reads can fail half-way (a file truncated or flipped
after an earlier check, an I/O error, a peer dying): the model is then half old, half new, and
TP ranks disagree. So every load reads into new tensors shaped and placed like the live ones
(``stage``); only after the read phase ended without error on every rank are the values copied
in (``ModelLoad.apply``), which allocates nothing and cannot fail half-way for I/O reasons.

The price is memory: one staged copy of what this rank loads (its shards of the loaded
parameters and buffers), held from the read until the swap; ``ModelLoad.nbytes`` says how much.
Where that copy would not fit (``journal.Policy``), ``begin`` starts the load in journal mode
instead: the read goes through buckets that overwrite the live tensors, their old values kept in
an undo journal on disk, and a failure anywhere puts them back (``fail``). A resume armed before
the optimizer exists keeps the model's previous values (in the staging tensors, or in the
journal) until the optimizer part is applied, so a refused optimizer part can put the model back
(``restore``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from ...materialize.state_dict import LoadReport
from ...tp.layout import from_local_like, local_part
from ..safety.errors import run_phase
from .journal import Cost, Journal, Policy


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


def why_unwritable(parts) -> str | None:
    """Why a load cannot write into a tensor whose local memory is ``parts`` (a shard, or a
    ShardedTensor's local shards), or None: on the meta device (a copy into it does nothing, so
    the load "succeeded" leaving it unset) or an expanded view (the copy raises, after other
    tensors were already written). v1's and v2's loads both ask this before reading."""
    if any(t.is_meta for t in parts):
        return ("a tensor on the meta device, which a load cannot change (materialize the model first, e.g. "
                "to_empty() and its initialization, then load)")
    if any(n > 1 and st == 0 for t in parts for n, st in zip(t.shape, t.stride())):
        return ("an expanded view (stride 0 along a dimension of size > 1), which a load cannot write into without "
                "the others' values ending in the same memory: clone() it first")
    return None


def unwritable(live: dict[str, torch.Tensor], keys) -> list[str]:
    """The keys whose live tensor a load cannot write (``why_unwritable``), each with why."""
    return [f"{key}: {why}" for key in keys if (why := why_unwritable([local_part(live[key])])) is not None]


def begin(report: LoadReport, live: dict[str, torch.Tensor], keys, policy: Policy | None) -> "ModelLoad":
    """A load of ``keys`` into ``live``: staged in memory, or through an undo journal when
    ``policy`` says the staged copy would not fit. No collective: callers run it in a phase
    (``agreed``), since it raises ``ValueError`` for ``unwritable`` targets, which may be on
    one rank only."""
    keys = sorted(keys)
    problems = unwritable(live, keys)
    if problems:
        raise ValueError("a load cannot write into " + "; ".join(problems))
    need = nbytes({k: live[k] for k in keys})
    if policy is not None and policy.use_journal(need):
        return ModelLoad(report, live, keys=keys, journal=Journal(policy.bucket))
    return ModelLoad(report, live, stage(live, keys), keys=keys)


def agreed(phase: str, make) -> "ModelLoad":
    """Run ``make()`` (no collectives; returns a ``ModelLoad`` it filled) as a phase every rank
    agrees on: if it failed anywhere, this rank's load is undone before raising."""
    made: list[ModelLoad] = []
    try:
        run_phase(phase, lambda: made.append(make()))
    except BaseException as e:
        if made:
            made[0].restore(e)
        raise
    return made[0]


@dataclass
class ModelLoad:
    """A model load read and verified into ``staged`` (``apply`` makes it live), or, in journal
    mode, already written into ``live`` with the old values in ``journal``."""

    report: LoadReport
    live: dict[str, torch.Tensor]
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    swapped: bool = False
    keys: list[str] = field(default_factory=list)
    journal: Journal | None = None
    cost: Cost | None = None

    def __post_init__(self):
        if not self.keys:
            self.keys = sorted(self.staged)
        self.cost = Cost("memory", nbytes(self.staged))

    @property
    def nbytes(self) -> int:
        return nbytes(self.staged)

    def targets(self) -> dict[str, torch.Tensor]:
        """Where a read puts each key's values: the staged tensors, or in journal mode the live
        ones (a ``journal.BucketPlanner`` then reads through buckets)."""
        return self.staged if self.journal is None else {k: self.live[k] for k in self.keys}

    def put(self, key: str, piece: torch.Tensor) -> None:
        """This rank's values of ``key`` (its local shape): staged, or journaled and written."""
        if self.journal is None:
            with torch.no_grad():
                local_part(self.staged[key]).copy_(piece)
        else:
            self.journal.write(local_part(self.live[key]), piece)

    def run(self, phase: str, fn) -> None:
        """Run the read ``fn`` as a phase every rank agrees on; on failure anywhere, put back
        what it wrote (journal mode) before raising. The journal's last bucket is applied
        inside the phase, so its errors are agreed too."""
        def read():
            fn()
            if self.journal is not None:
                self.journal.flush()

        try:
            run_phase(phase, read)
        except BaseException as e:
            self.restore(e)
            raise
        self.cost = self.journal_cost()

    def journal_cost(self) -> Cost:
        """What the load cost so far: the staged bytes, or the journal's bucket peak and size."""
        if self.journal is None:
            return self.cost
        return Cost.of(self.journal)

    def apply(self, keep_old: bool = False) -> None:
        """Copy the staged values into the live tensors. ``keep_old``: exchange them instead,
        so ``restore`` can put the previous values back (one tensor of scratch at a time). In
        journal mode the values are live already; ``keep_old`` keeps the journal."""
        if self.journal is not None:
            self.swapped = keep_old
            if not keep_old:
                self.release()
            return
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

    def restore(self, error: BaseException | None = None) -> None:
        """Undo what the load changed (``apply(keep_old=True)``, or a journal's writes); raises
        ``journal.JournalError`` if the journal could not put everything back."""
        if self.journal is not None:
            journal, self.journal = self.journal, None
            self.staged, self.swapped = {}, False
            journal.abort(error or RuntimeError("the resume was refused"))
            return
        if self.swapped:
            with torch.no_grad():
                for key, old in self.staged.items():
                    local_part(self.live[key]).copy_(local_part(old))
        self.staged, self.swapped = {}, False

    def release(self) -> None:
        """Forget the previous values (the load is final)."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        self.staged, self.swapped = {}, False
