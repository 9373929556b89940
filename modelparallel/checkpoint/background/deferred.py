"""What background staging checks: each deferred tensor's bytes at the call, against its copy.

A tensor whose copy is left to the background thread (``async_save.Stager.defer``) may be
changed in place before that copy by any means: ``p.data.mul_()`` and numpy views bypass the
version counter. So the call takes the CRC32 of its bytes (``fingerprint``; ``Early`` reads them
in a few threads while the call does its other work, where a rank has a core to spare), and the
copy is compared with it (``Deferred``). Reading is the cheaper way: a CRC32 (zlib-ng) reads about
1.7x faster than a copy writes (``bench/bench_v2_async_save.py``'s ``read_vs_copy``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..safety.files import crc32


@dataclass
class Deferred:
    """A copy left to the background: the live tensor (a DTensor's local shard in ``local``),
    its staging buffer, the CRC32 of its bytes at the call (``None``: already copied by the call
    on a GPU stream, ``event`` marks the copy's end), and the version counters of the tensors
    ``watched`` (itself and aliases such as FSDP's original parameters over a flat one) at the
    call: a cheap second check, for a change through an alias whose memory is not the saved one."""

    name: str
    buffer: torch.Tensor
    local: torch.Tensor
    crc: int | None
    event: Any = None
    watched: tuple = ()
    versions: tuple = ()

    def __post_init__(self):
        self.versions = tuple(t._version for t in self.watched)

    def copy(self) -> bool:
        """Fill the buffer; True if it now holds the bytes of the call and no watched tensor
        was changed in place."""
        if self.crc is None:
            self.event.synchronize()
        else:
            self.buffer.copy_(self.local.detach())
        same = self.crc is None or fingerprint(self.buffer) == self.crc
        return same and tuple(t._version for t in self.watched) == self.versions


def fingerprint(t: torch.Tensor) -> int:
    """CRC32 of the bytes of a contiguous CPU tensor (any dtype)."""
    flat = t.detach()
    return crc32((flat if flat.dim() == 1 else flat.reshape(-1)).view(torch.uint8).numpy())


class Early:
    """CRC32s of tensors computed by a few threads (zlib releases the GIL while it reads), keyed
    by the memory they cover. Reading the deferred tensors is most of what an asynchronous save's
    call costs on a CPU, and the tensors are independent: up to ``MAX_THREADS`` of them are read
    at once, in the order given (the order ``defer`` takes them), and ``take`` waits for one
    tensor's sum only. Threads beyond this rank's share of the machine's cores only compete with
    the other ranks; with a core per rank none is started (``pays``)."""

    MAX_THREADS = 4

    @staticmethod
    def share() -> int:
        """This rank's share of the machine's cores (the cores over the ranks on it)."""
        return (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    @classmethod
    def pays(cls) -> bool:
        """Whether reading in threads can shorten the call: only with a core to spare beside the
        caller's. With one core per rank a reading thread only takes turns with the call (2
        cores, 2 ranks, v2 bench: 20-22 ms of CPU per call with one thread against 15-18 ms
        reading in the call itself), so the call reads the tensors as it stages them."""
        return cls.share() >= 2

    def __init__(self, tensors: list[torch.Tensor]):
        todo = [t for t in tensors if t.device.type == "cpu" and t.is_contiguous()]
        threads = max(1, min(self.MAX_THREADS, self.share(), len(todo)))
        pool = ThreadPoolExecutor(threads, thread_name_prefix="modelparallel-crc")
        self.sums: dict[tuple, Future] = {}
        for t in todo:
            self.sums.setdefault(self.key(t), pool.submit(fingerprint, t))
        pool.shutdown(wait=False)  # the threads end when the queue is done

    @staticmethod
    def key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), t.numel() * t.element_size(), t.dtype

    def take(self, t: torch.Tensor) -> int | None:
        """``t``'s CRC32 taken by the threads (None: not one of theirs, or their read failed,
        and the caller reads it itself)."""
        pending = self.sums.get(self.key(t))
        if pending is None:
            return None
        try:
            return pending.result()
        except Exception:  # noqa: BLE001 - the caller's own read reports what is wrong
            return None
