"""The file objects a save writes through: checksummed as written, written back as they go.

``RecordingFileSystem`` is DCP's ``FileSystem`` whose write streams (``_Stream``)

* record a failed write's ``OSError`` naming the file before it propagates (a file object's
  error names no file, and ``torch.save`` would replace it by ``unexpected pos``);
* compute the size and CRC32 of the bytes as they pass (``sums``), so the commit needs no
  second read of what was just written;
* every ``SYNC_EVERY`` bytes start the write-back of what was written since (Linux
  ``sync_file_range``), wait for the range started the time before and drop it from the page
  cache (drop-behind): the disk writes while the rest is serialized, the final fsync finds
  little left, and a save holds at most two ranges of each file in the page cache instead of the
  whole checkpoint. Measured on this VM (medium preset, 4.26 GB, 6 alternating repeats): saves
  took 2.15-2.22 s with drop-behind against 2.66-3.79 s without. Pages a save leaves in the page
  cache are taken from memory it must first get from the host (this VM gives freed memory back),
  and they push out what the job's own files had cached; dropped pages are reused at once by the
  next range. A failed write-back (EIO, ENOSPC) seen while waiting is raised naming the file:
  the kernel reports it once, and a later fsync of the file would not.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from ..safety.crc import crc32
from ..safety.durable import named  # importable from here too, where callers have found it

SYNC_EVERY = 32 << 20
"""Bytes written to a file between two starts of its write-back."""

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4
_FAILED_WRITEBACK = (errno.EIO, errno.ENOSPC, errno.EDQUOT)
"""Errors of a write-back that mean the file's bytes did not reach the disk; any other error of
``sync_file_range`` (a file system that does not support it) only ends the early write-back."""


@functools.cache  # one handle for the process: each writer of each save asks for it
def _sync_file_range():
    """Linux's ``sync_file_range``, or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


class _Stream:
    """A file object written front to back: failed writes recorded, bytes checksummed, written
    back and dropped behind every ``SYNC_EVERY`` bytes (see the module's docstring)."""

    def __init__(self, stream, path, errors: list[OSError], sync_range, drop_behind: bool = True):
        self._stream, self._path, self._errors = stream, path, errors
        self._sync_range, self._drop_behind = sync_range, drop_behind
        self.size = self.crc = self._synced = self._dropped = 0
        self.sequential = True

    def write(self, data) -> int:
        try:
            n = self._stream.write(data)
        except OSError as e:
            self._errors.append(named(e, self._path))
            raise
        view = memoryview(data).cast("B")
        n = len(view) if n is None else n
        self.crc = crc32(view[:n], self.crc)
        self.size += n
        if self._sync_range is not None and self.size - self._synced >= SYNC_EVERY:
            self._writeback()
        return n

    def _writeback(self) -> None:
        self._stream.flush()
        fd = self._stream.fileno()
        if self._drop_behind and self._synced > self._dropped:  # the range started last time: wait, drop
            self._call(fd, self._dropped, self._synced, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            if self._sync_range is None:
                return
            with contextlib.suppress(OSError):  # dropping is only an economy: a refusal changes no byte
                os.posix_fadvise(fd, self._dropped, self._synced - self._dropped, os.POSIX_FADV_DONTNEED)
            self._dropped = self._synced
        self._call(fd, self._synced, self.size, _WRITE)
        self._synced = self.size

    def _call(self, fd: int, start: int, end: int, flags: int) -> None:
        """``sync_file_range`` of ``[start, end)``: a failed write-back raises (recorded, naming
        the file); any other failure stops the early write-back of this file."""
        if self._sync_range(fd, start, end - start, flags) == 0:
            return
        code = ctypes.get_errno()
        if code in _FAILED_WRITEBACK:
            error = OSError(code, os.strerror(code), str(self._path))
            self._errors.append(error)
            raise error
        self._sync_range = None

    def seek(self, *args):
        self.sequential = False  # the running checksum no longer describes the file
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class RecordingFileSystem(FileSystem):
    """DCP's ``FileSystem`` writing through ``_Stream``: ``errors`` (failed writes, naming their
    files) and ``sums`` (``{path: {"size", "crc32"}}`` of files written front to back).
    ``drop_behind=False`` only starts each range's write-back (the checkpoint stays cached)."""

    def __init__(self, drop_behind: bool = True):
        super().__init__()
        self._drop_behind = drop_behind
        self.errors: list[OSError] = []
        self.sums: dict[str, dict] = {}
        self._sync_range = _sync_file_range() if hasattr(os, "posix_fadvise") else None

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        self.sums.pop(os.fspath(path), None)
        with super().create_stream(path, mode) as stream:
            wrapped = _Stream(stream, path, self.errors, self._sync_range, self._drop_behind)
            yield wrapped
        if wrapped.sequential:
            self.sums[os.fspath(path)] = {"size": wrapped.size, "crc32": f"{wrapped.crc:08x}"}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        moved = self.sums.pop(os.fspath(path), None)
        if moved is not None:
            self.sums[os.fspath(new_path)] = moved
