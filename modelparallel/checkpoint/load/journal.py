"""All-or-nothing loads in bounded memory: an undo journal instead of a second copy.

Staging in memory (``staging``) keeps a full second copy of what a rank loads until every rank
read and verified everything. Where that copy would not fit, a load runs in journal mode (what
SQLite's rollback journal does for a database file): it reads into a bucket of at most
``Policy.bucket`` bytes; when the bucket is full, the live values it is about to overwrite are
appended to an undo journal on local disk, then the bucket is copied in. If the load then fails
on any rank (every rank learns it from the phase agreement, ``errors.run_phase``), each rank
copies the journaled values back, newest first, so every tensor the load wrote ends bit for bit
as it was. The journal is deleted when the load ends, whether it succeeded or failed.

Where: a private directory made by ``tempfile.mkdtemp`` (``TMPDIR``, normally local disk), not
the checkpoint directory, which may be read-only, shared with other jobs (whose retention
manages its hidden names) or remote. The journal serves only this process, so it is not fsynced:
a process that dies mid-load loses its model anyway (its journal is then left in ``TMPDIR``).

Cost: in memory, at most one bucket plus the piece being read (a piece larger than the bucket is
a bucket by itself); on disk, one copy of what the load overwrites.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import STAGING_MODES as MODES
from ...host_bytes import host_bytes
from ..safety.errors import CheckpointError
from .fastread import SafeLoadPlanner

logger = logging.getLogger("modelparallel")

DEFAULT_BUCKET = 64 << 20
MEMORY_SHARE = 0.5
"""``auto`` stages in memory only if every rank of the node together needs at most this share of
``MemAvailable``: the rest is left to the reader's buffers and to everything else running."""


class JournalError(CheckpointError):
    """A failed load could not put every overwritten tensor back: the model (or optimizer) holds
    a mix of old and loaded values."""


def mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class Policy:
    """How a load protects the live tensors: ``mode`` "memory" (a staged copy), "journal" (an
    undo journal, buckets of ``bucket`` bytes) or "auto" (memory if it fits, see
    ``MEMORY_SHARE``); ``local_ranks``: the ranks of this node, all loading at once."""

    mode: str = "auto"
    bucket: int = DEFAULT_BUCKET
    local_ranks: int = 1

    def use_journal(self, nbytes: int) -> bool:
        """Whether a load that would stage ``nbytes`` on this rank runs in journal mode."""
        if self.mode != "auto":
            return self.mode == "journal"
        available = mem_available()
        return nbytes > 0 and available is not None and nbytes * self.local_ranks > available * MEMORY_SHARE


def check_policy(mode, bucket) -> list[str]:
    """Problems with a ``staging`` mode and bucket size given by the user (empty: fine)."""
    problems = []
    if mode not in MODES:
        problems.append(f"staging must be one of {MODES}, got {mode!r}")
    if not isinstance(bucket, int) or isinstance(bucket, bool) or bucket < 1:
        problems.append(f"staging bucket must be a number of bytes >= 1, got {bucket!r}")
    return problems


class Journal:
    """The undo journal of one load on this rank (see the module docstring). Its file is made
    at the first write, inside the load's read phase, so that failing to make it is an error
    every rank agrees on like any other."""

    def __init__(self, bucket: int = DEFAULT_BUCKET):
        self.bucket = bucket
        self.directory: Path | None = None
        self.fd: int | None = None
        self.records: list[tuple[torch.Tensor, int]] = []  # (live view written, offset of its old bytes)
        self.journaled = 0
        self.held, self.peak = 0, 0
        self.waiting: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, live: torch.Tensor, new: torch.Tensor) -> None:
        """Queue ``new`` for ``live`` (a view of a live tensor); the bucket is applied when full."""
        self.waiting.append((live, new))
        self.held += new.numel() * new.element_size()
        self.peak = max(self.peak, self.held)
        if self.held >= self.bucket:
            self.flush()

    def flush(self) -> None:
        """Apply the bucket: each live value journaled, then overwritten."""
        for live, new in self.waiting:
            self._apply(live, new, self.held)
        self.waiting.clear()
        self.held = 0

    def write(self, live: torch.Tensor, new: torch.Tensor) -> None:
        """Journal and overwrite ``live`` with ``new`` at once (a bucket of one piece)."""
        self._apply(live, new, new.numel() * new.element_size())

    @property
    def path(self) -> Path | None:
        return self.directory / "undo" if self.directory is not None else None

    def _open(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="mp-journal-"))
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def _apply(self, live: torch.Tensor, new: torch.Tensor, held: int) -> None:
        """Append ``live``'s current bytes to the journal, then copy ``new`` into it; ``held``:
        the bytes read and not yet applied, for the peak."""
        if self.fd is None:
            self._open()
        old = live.detach().to("cpu").contiguous()
        data = host_bytes(old)
        self.peak = max(self.peak, held + (len(data) if old.data_ptr() != live.data_ptr() else 0))
        done = 0
        while done < len(data):
            try:
                done += os.write(self.fd, data[done:])
            except OSError as e:
                raise type(e)(e.errno, e.strerror, f"{self.path} (the resume's undo journal)") from None
        self.records.append((live, self.journaled))
        self.journaled += len(data)
        with torch.no_grad():
            live.copy_(new)

    def rollback(self) -> list[str]:
        """Put every journaled value back, newest first; returns what could not be put back."""
        self.waiting.clear()
        failed = []
        for live, offset in reversed(self.records):
            old = torch.empty(live.shape, dtype=live.dtype)
            try:
                self._read(host_bytes(old), offset)
            except OSError as e:
                failed.append(f"{tuple(live.shape)} {live.dtype} at byte {offset}: {e}")
                continue
            with torch.no_grad():
                live.copy_(old)
        self.records.clear()
        return failed

    def _read(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"the journal ends at byte {offset + done}")
            done += got

    def close(self) -> None:
        """Delete the journal (its directory is private to this load)."""
        self.waiting.clear()
        self.records.clear()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            if self.directory.exists():
                logger.warning("could not delete the resume's undo journal %s", self.directory)

    def abort(self, error: BaseException) -> None:
        """The load failed with ``error``: roll back and delete the journal. Raises
        ``JournalError`` (chained to ``error``) naming the journal if anything stayed changed."""
        count = len(self.records)
        try:
            failed = self.rollback()
        finally:
            self.close()
        if failed:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise JournalError(
                f"{self.path}: restoring from this undo journal failed for {len(failed)} of {count} overwritten "
                f"tensors, so this rank's model/optimizer is NOT as it was before the resume (it mixes old and "
                f"checkpoint values): do not train on; restart the job. The resume itself failed with: {first}\n"
                "  - " + "\n  - ".join(failed[:10])) from error


class BucketPlanner(SafeLoadPlanner):
    """A DCP load planner that reads the pieces of the ``live`` keys into fresh bucket tensors
    and hands each read piece to ``journal`` (which journals and overwrites the live piece when
    its bucket is full); other keys are read straight into their destination."""

    def __init__(self, journal: Journal, live: set[str]):
        super().__init__()
        self.journal, self.live = journal, live

    def resolve_tensor(self, read_item):
        dest = super().resolve_tensor(read_item)
        if read_item.dest_index.fqn not in self.live:
            return dest
        return torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)

    def commit_tensor(self, read_item, tensor) -> None:
        if read_item.dest_index.fqn in self.live:
            self.journal.add(super().resolve_tensor(read_item), tensor)


@dataclass(frozen=True)
class Cost:
    """What protecting the live values during one part's load cost on this rank: ``mode``
    "memory" (``in_memory``: the staged copy's bytes) or "journal" (``in_memory``: the most
    held in buckets at once; ``journaled``: bytes written to the journal in ``where``)."""

    mode: str
    in_memory: int
    journaled: int = 0
    where: Path | None = None

    def __str__(self) -> str:
        if self.mode == "memory":
            return f"staged {_size(self.in_memory)} in memory"
        return f"undo journal: {_size(self.in_memory)} in memory at most, {_size(self.journaled)} journaled" + \
            (f" in {self.where}" if self.where else "")

    @staticmethod
    def of(journal: "Journal") -> "Cost":
        return Cost("journal", journal.peak, journal.journaled, journal.directory)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
