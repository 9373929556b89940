"""DCP's file-system writer, with write errors that keep their cause and name their file.

DCP writes each chunk with ``torch.save`` into a file object. When a write of that file object
fails (disk full, EIO) after its first one, ``torch.save``'s zip writer replaces the error by
``unexpected pos N vs M``, and DCP then sends only that text to the other ranks: the cause and
the file are lost. ``CheckpointWriter`` keeps every failed write's ``OSError`` (naming the file)
as it happens, and ``save`` raises the first one instead of what DCP reports.

It also makes a save run at the disk's speed rather than in passes over the data:

* its files are written through ``stream.RecordingFileSystem``: the size and CRC32 of every
  file computed from the bytes as they are written (``sums``), so the commit needs no second
  read (it fsyncs only); write-back started as the file grows and dropped behind;
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
import queue
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...compat import StorageInfo
from .records import TensorRecords
from .stream import RecordingFileSystem

THREADS = 1
"""Files each rank writes at once (one thread each). One: with every tensor's serialization
reduced to three writes (``records``), a second thread finds little to overlap with the first's
page-cache copies and competes with them for the core (measured: two threads per rank made a
2-rank save on 2 cores slower)."""


class CheckpointWriter(FileSystemWriter):
    """``FileSystemWriter`` recording its failed writes (``errors``); DCP's own fsync off (the
    caller fsyncs while it checksums). It writes the files DCP's writer writes (same names,
    items, order and offsets, each tensor as ``torch.save`` writes it), ``threads`` files per
    rank at once, tensors through ``records.TensorRecords``; an error in any of its threads is
    raised (DCP's would end that thread only)."""

    def __init__(self, path: str | Path, threads: int = THREADS, drop_behind: bool = True):
        super().__init__(path, sync_files=False, thread_count=threads)
        self.fs = RecordingFileSystem(drop_behind)

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


def save(state: dict[str, Any], directory: Path, planner, group=None, drop_behind: bool = True) -> dict[str, dict]:
    """One DCP save of ``state`` into ``directory`` (a collective over ``group``, default the
    world). Returns ``{path: {"size", "crc32"}}`` of the files this rank wrote, computed while
    writing (not yet fsynced).

    Raises:
        OSError: this rank's first failed write, naming its file (not torch.save's
            ``unexpected pos``).
        CheckpointException: another rank's failure, as DCP reports it.
    """
    writer = CheckpointWriter(directory, drop_behind=drop_behind)
    try:
        with _no_zip_crc():
            dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
    except (CheckpointException, OSError, RuntimeError) as e:
        if writer.errors:
            raise writer.errors[0] from e
        raise
    return dict(writer.sums)
