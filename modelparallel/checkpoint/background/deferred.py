"""What background staging checks: each deferred tensor's bytes at the call, against its copy.

A tensor whose copy is left to the background thread (``async_save.Stager.defer``) may be
changed in place before that copy by any means: ``p.data.mul_()`` and numpy views bypass the
version counter. Where the kernel tracks writes, the call write-protects its pages
(``pages.PageWatch``) and the background thread asks after the copy whether any was written:
nothing is read in the call. Elsewhere the call takes the CRC32 of its bytes (``fingerprint``;
``Early`` reads them in a few threads while the call does its other work, where a rank has a core
to spare), and the copy is compared with it (``Deferred``). Reading is the cheaper of the two other
ways: a CRC32 (zlib-ng) reads about 1.7x faster than a copy writes
(``bench/bench_v2_async_save.py``'s ``read_vs_copy``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ... import cpus
from ...host_bytes import host_bytes
from ..safety.files import crc32
from .device import word_sum


HOST, STREAM, SNAPSHOT, LIVE = "host", "stream", "snapshot", "live"
"""How a deferred tensor is staged: a host tensor copied by the background thread and checked by
CRC32 (``HOST``); a GPU tensor copied into a pinned buffer on a side stream enqueued by the call
(``STREAM``), copied on the device by the call and moved to the host in the background
(``SNAPSHOT``), or copied live by the background thread (``LIVE``); ``STREAM`` and ``LIVE`` copies
are checked by ``device.word_sum`` (see ``device``)."""


@dataclass
class Deferred:
    """A copy left to the background: the tensor to copy (an alias of the live local shard's memory
    at the call, which ``p.data = x`` or ``set_`` on the shard later does not move; or a snapshot of
    it), its staging buffer, the fingerprint of its bytes at the call (``crc``: a CRC32 for
    ``HOST``, a device ``word_sum`` for ``STREAM`` and ``LIVE``), the event after the call's work
    on its GPU stream (after the side stream's copy for ``STREAM``), and the version counters of the tensors ``watched`` (itself and aliases such as
    FSDP's original parameters over a flat one) at the call: a cheap second check, for a change
    through an alias whose memory is not the saved one. The optimizer's step waits on the host
    for the copies the background thread makes of live memory (``reads_live``), on its GPU stream
    for ``STREAM`` copies (``Stager.stream_events``)."""

    name: str
    buffer: torch.Tensor
    local: torch.Tensor | None
    kind: str = HOST
    crc: Any = None
    event: Any = None
    watched: tuple = ()
    versions: tuple = ()
    pages: Any = None
    """For ``HOST``: the tensor's pages write-protected at the call (``pages.Protected``; ``crc`` is
    then the CRC32 of its bytes outside them), or None (``crc`` covers all its bytes)."""

    def __post_init__(self):
        self.versions = tuple(t._version for t in self.watched)

    @property
    def reads_live(self) -> bool:
        return self.kind in (HOST, LIVE)

    def copy(self, streams: Any = None) -> bool:
        """Fill the buffer; True if it now holds the bytes of the call and no watched tensor
        was changed in place. A GPU copy made here runs on ``streams``' side stream for the
        device, after the call's work on the tensor's stream."""
        if self.kind == HOST:
            self.buffer.copy_(self.local.detach())
            if self.pages is None:
                same = fingerprint(self.buffer) == self.crc
            else:  # asked after the copy: no page written since the call means the copy is the call's
                same = self.pages.edges(self.buffer) == self.crc and not self.pages.written()
        else:  # on the side stream: after the call's work (a stream copy: after itself)
            with after(self.event, self.local.device, streams):
                if self.kind != STREAM:
                    self.buffer.copy_(self.local.detach())
                want = int(self.crc.item()) if self.crc is not None else None
            self.local = None  # a snapshot's device memory is freed now
            same = want is None or int(word_sum(self.buffer).item()) == want
        return same and tuple(t._version for t in self.watched) == self.versions


@contextmanager
def after(event: Any, device: torch.device, streams: Any) -> Iterator[None]:
    """Run the block on the device's side stream once ``event`` (the call's work) is done, and
    wait for it; no event (a host tensor): run it as it is."""
    if event is None:
        yield
        return
    side = streams.of(device)
    side.wait_event(event)
    with torch.cuda.stream(side):
        yield
    side.synchronize()


def fingerprint(t: torch.Tensor) -> int:
    """CRC32 of the bytes of a contiguous CPU tensor (any dtype)."""
    return crc32(host_bytes(t))


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
        return cpus.usable() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

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
