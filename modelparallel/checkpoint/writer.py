"""DCP's file-system writer, with write errors that keep their cause and name their file.

DCP writes each chunk with ``torch.save`` into a file object. When a write of that file object
fails (disk full, EIO) after its first one, ``torch.save``'s zip writer replaces the error by
``unexpected pos N vs M``, and DCP then sends only that text to the other ranks: the cause and
the file are lost. ``CheckpointWriter`` keeps every failed write's ``OSError`` (naming the file)
as it happens, and ``save`` raises the first one instead of what DCP reports.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem


def named(error: OSError, path) -> OSError:
    """``error`` naming ``path`` (an error from a file object names no file)."""
    if not isinstance(error, OSError) or error.filename or error.errno is None:
        return error
    return type(error)(error.errno, error.strerror or str(error), str(path))


class _Stream:
    """A file object whose failed writes are recorded (naming the file) before they propagate."""

    def __init__(self, stream, path, errors: list[OSError]):
        self._stream, self._path, self._errors = stream, path, errors

    def write(self, data) -> int:
        try:
            return self._stream.write(data)
        except OSError as e:
            self._errors.append(named(e, self._path))
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _RecordingFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            yield _Stream(stream, path, self.errors) if "w" in mode or "a" in mode else stream


class CheckpointWriter(FileSystemWriter):
    """``FileSystemWriter`` recording its failed writes (``errors``); DCP's own fsync off (the
    caller fsyncs while it checksums)."""

    def __init__(self, path: str | Path):
        super().__init__(path, sync_files=False)
        self.fs = _RecordingFileSystem()

    @property
    def errors(self) -> list[OSError]:
        return self.fs.errors


def save(state: dict[str, Any], directory: Path, planner, group=None) -> None:
    """One DCP save of ``state`` into ``directory`` (a collective over ``group``, default the
    world).

    Raises:
        OSError: this rank's first failed write, naming its file (not torch.save's
            ``unexpected pos``).
        CheckpointException: another rank's failure, as DCP reports it.
    """
    writer = CheckpointWriter(directory)
    try:
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
    except (CheckpointException, OSError, RuntimeError) as e:
        if writer.errors:
            raise writer.errors[0] from e
        raise
