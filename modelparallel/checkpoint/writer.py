"""DCP's file-system writer, with write errors that keep their cause and name their file.

DCP writes each chunk with ``torch.save`` into a file object. When a write of that file object
fails (disk full, EIO) after its first one, ``torch.save``'s zip writer replaces the error by
``unexpected pos N vs M``, and DCP then sends only that text to the other ranks: the cause and
the file are lost. ``CheckpointWriter`` keeps every failed write's ``OSError`` (naming the file)
as it happens, and ``save`` raises the first one instead of what DCP reports.

It also makes a save run at the disk's speed rather than in passes over the data:

* the size and CRC32 of every file are computed from the bytes as they are written (``sums``),
  so the commit needs no second read of what was just written (it fsyncs only);
* every ``SYNC_EVERY`` bytes the file's write-back is started (Linux ``sync_file_range``), so the
  disk writes while the rest is serialized and the final fsync finds little left, instead of the
  whole file waiting in the page cache until then;
* ``torch.save``'s own CRC-32 of every zip record (a slow table-driven pass that halves its
  speed) is off while the save writes: the manifest's CRC32 of every file, computed here at
  several GB/s, is what a load verifies, and ``torch.load`` never checks the zip's. PyTorch keeps
  that setting per thread (per context), so a background save switches it off for its own thread
  and the ``torch.save`` calls training makes meanwhile keep theirs; where a PyTorch keeps it
  process-wide (``_crc_setting_is_per_thread``), only a save in the main thread switches it;
* with the zip CRC off, each tensor is written as ``torch.save`` writes it but without calling it
  (``records.TensorRecords``): its records made once per tensor signature, the data in one write.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import queue
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..compat import StorageInfo
from .records import TensorRecords

try:  # zlib's CRC-32 with SIMD, same values, about 3x faster (pip install modelparallel[fastcrc])
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32

SYNC_EVERY = 32 << 20
"""Bytes written to a file between two starts of its write-back."""

THREADS = 1
"""Files each rank writes at once (one thread each). One: with every tensor's serialization
reduced to three writes (``records``), a second thread finds little to overlap with the first's
page-cache copies and competes with them for the core (measured: two threads per rank made a
2-rank save on 2 cores slower)."""

_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    """Linux's ``sync_file_range`` (start write-back of a range, do not wait), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def named(error: OSError, path) -> OSError:
    """``error`` naming ``path`` (an error from a file object names no file)."""
    if not isinstance(error, OSError) or error.filename or error.errno is None:
        return error
    return type(error)(error.errno, error.strerror or str(error), str(path))


class _Stream:
    """A file object written front to back: its failed writes are recorded (naming the file)
    before they propagate, its bytes are checksummed as they pass, and its write-back is started
    every ``SYNC_EVERY`` bytes."""

    def __init__(self, stream, path, errors: list[OSError], start_writeback):
        self._stream, self._path, self._errors = stream, path, errors
        self._start_writeback = start_writeback
        self.size = self.crc = self._synced = 0
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
        if self._start_writeback is not None and self.size - self._synced >= SYNC_EVERY:
            self._writeback()
        return n

    def _writeback(self) -> None:
        self._stream.flush()
        if self._start_writeback(self._stream.fileno(), self._synced, self.size - self._synced,
                                 _SYNC_FILE_RANGE_WRITE) == 0:
            self._synced = self.size

    def seek(self, *args):
        self.sequential = False  # the running checksum no longer describes the file
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _RecordingFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.errors: list[OSError] = []
        self.sums: dict[str, dict] = {}
        self._start_writeback = _sync_file_range()

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        self.sums.pop(os.fspath(path), None)
        with super().create_stream(path, mode) as stream:
            wrapped = _Stream(stream, path, self.errors, self._start_writeback)
            yield wrapped
        if wrapped.sequential:
            self.sums[os.fspath(path)] = {"size": wrapped.size, "crc32": f"{wrapped.crc:08x}"}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        moved = self.sums.pop(os.fspath(path), None)
        if moved is not None:
            self.sums[os.fspath(new_path)] = moved


class CheckpointWriter(FileSystemWriter):
    """``FileSystemWriter`` recording its failed writes (``errors``); DCP's own fsync off (the
    caller fsyncs while it checksums). It writes the files DCP's writer writes (same names,
    items, order and offsets, each tensor as ``torch.save`` writes it), ``threads`` files per
    rank at once, tensors through ``records.TensorRecords``; an error in any of its threads is
    raised (DCP's would end that thread only)."""

    def __init__(self, path: str | Path, threads: int = THREADS):
        super().__init__(path, sync_files=False, thread_count=threads)
        self.fs = _RecordingFileSystem()

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future:
        results: list[WriteResult] = []
        failures: list[BaseException] = []
        records = TensorRecords()

        def work():
            try:
                while not failures:
                    try:
                        path, name, items = file_queue.get_nowait()
                    except queue.Empty:
                        return
                    results.extend(self._write_file(planner, records, path, name, items))
            except BaseException as e:  # raised by the calling thread below
                failures.append(e)

        # each thread in a copy of the caller's context: PyTorch's serialization settings (the zip
        # CRC switched off for this save) are per context, and a new thread starts with the defaults
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(work,), daemon=True,
                                    name=f"checkpoint-writer-{i}") for i in range(1, self.thread_count)]
        for t in threads:
            t.start()
        work()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        done: Future = Future()
        done.set_result(results)
        return done

    def _write_file(self, planner: SavePlanner, records: TensorRecords, path, name: str,
                    items: list[WriteItem]) -> list[WriteResult]:
        """One file: its byte items, then its tensors (DCP's order), each item's offset and
        length recorded for DCP's metadata."""
        out = []
        with self.fs.create_stream(path, "wb") as stream:
            for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    records.write(_own_storage(data), stream)
                length = stream.tell() - offset
                out.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=StorageInfo(name, offset, length)))
        return out

    @property
    def errors(self) -> list[OSError]:
        return self.fs.errors

    @property
    def sums(self) -> dict[str, dict]:
        """``{path: {"size", "crc32"}}`` of the files this writer wrote front to back."""
        return self.fs.sums


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU holding a storage of its own size (``torch.save`` writes a view's
    whole storage), as DCP's writer passes it to ``torch.save``."""
    tensor = tensor.detach().cpu()
    return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor


def _crc_setting_is_per_thread() -> bool:
    """Whether ``torch.serialization.set_crc32_options`` in one thread leaves the other threads'
    setting alone (PyTorch keeps its serialization config per context): switched off here for a
    moment, a new thread still sees it on."""
    before = torch.serialization.get_crc32_options()
    seen: list[bool] = []
    torch.serialization.set_crc32_options(False)
    try:
        thread = threading.Thread(target=lambda: seen.append(torch.serialization.get_crc32_options()))
        thread.start()
        thread.join()
    finally:
        torch.serialization.set_crc32_options(before)
    return seen == [True]


@contextlib.contextmanager
def _no_zip_crc():
    if threading.current_thread() is not threading.main_thread() and not _crc_setting_is_per_thread():
        yield
        return
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def save(state: dict[str, Any], directory: Path, planner, group=None) -> dict[str, dict]:
    """One DCP save of ``state`` into ``directory`` (a collective over ``group``, default the
    world). Returns ``{path: {"size", "crc32"}}`` of the files this rank wrote, computed while
    writing (not yet fsynced).

    Raises:
        OSError: this rank's first failed write, naming its file (not torch.save's
            ``unexpected pos``).
        CheckpointException: another rank's failure, as DCP reports it.
    """
    writer = CheckpointWriter(directory)
    try:
        with _no_zip_crc():
            dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
    except (CheckpointException, OSError, RuntimeError) as e:
        if writer.errors:
            raise writer.errors[0] from e
        raise
    return dict(writer.sums)
