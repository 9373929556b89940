"""What background staging checks: each deferred tensor's bytes at the call, against its copy.

A tensor whose copy is left to the background thread (``async_save.Stager.defer``) may be
changed in place before that copy by any means: ``p.data.mul_()`` and numpy views bypass the
version counter. So the call takes the CRC32 of its bytes (``fingerprint``; ``Early`` reads them
in a thread while the call does its other work), and the copy is compared with it (``Deferred``).
"""

from __future__ import annotations

import threading
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
    return crc32(t.detach().reshape(-1).view(torch.uint8).numpy())


class Early:
    """CRC32s of tensors computed by a thread (zlib releases the GIL while it reads), keyed by
    the memory they cover."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.sums: dict[tuple, int] = {}
        self.thread = threading.Thread(target=self._run, args=(tensors,), name="modelparallel-crc", daemon=True)
        self.thread.start()

    @staticmethod
    def key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), t.numel() * t.element_size(), t.dtype

    def _run(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type == "cpu" and t.is_contiguous():
                self.sums[self.key(t)] = fingerprint(t)

    def take(self, t: torch.Tensor) -> int | None:
        self.thread.join()
        return self.sums.get(self.key(t))
