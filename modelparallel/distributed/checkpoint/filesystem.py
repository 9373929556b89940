"""SageMaker v2's ``torch.sagemaker.distributed.checkpoint.filesystem``: DCP's file system reader
and writer under SageMaker's names (SageMaker's also reach S3, which is not built here)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

__all__ = ["DistributedFileSystemReader", "DistributedFileSystemWriter"]


def _local_path(path) -> str:
    path = os.fspath(path)
    if "://" in path:
        raise NotImplementedError(f"{path!r}: only file system paths are supported here (S3 is not built)")
    return path


class DistributedFileSystemReader(FileSystemReader):
    """Reads a DCP checkpoint directory (``load(..., storage_reader=DistributedFileSystemReader(path))``)."""

    def __init__(self, path: str | os.PathLike, *args, **kwargs):
        super().__init__(_local_path(path), *args, **kwargs)


class DistributedFileSystemWriter(FileSystemWriter):
    """Writes a DCP checkpoint directory. ``pre_write_hooks`` / ``post_write_hooks`` (SageMaker's):
    callables ``hook(writer)`` run on every rank before it writes its files, and after the
    checkpoint is committed (``writer.path`` is then the checkpoint's directory, complete)."""

    def __init__(self, path: str | os.PathLike, *args, pre_write_hooks: Sequence[Callable] = (),
                 post_write_hooks: Sequence[Callable] = (), **kwargs):
        super().__init__(_local_path(path), *args, **kwargs)
        self.pre_write_hooks, self.post_write_hooks = list(pre_write_hooks), list(post_write_hooks)

    def write_data(self, plan, planner):
        for hook in self.pre_write_hooks:
            hook(self)
        return super().write_data(plan, planner)

    def committed(self) -> None:
        """Called by the save on every rank once the checkpoint is committed."""
        for hook in self.post_write_hooks:
            hook(self)
