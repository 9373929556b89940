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
    callables ``hook(writer)`` run on every rank before it writes its files and after the
    checkpoint's metadata is written (on the coordinator) or its files are (elsewhere)."""

    def __init__(self, path: str | os.PathLike, *args, pre_write_hooks: Sequence[Callable] = (),
                 post_write_hooks: Sequence[Callable] = (), **kwargs):
        super().__init__(_local_path(path), *args, **kwargs)
        self.pre_write_hooks, self.post_write_hooks = list(pre_write_hooks), list(post_write_hooks)
        self.is_coordinator = False

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator

    def write_data(self, plan, planner):
        for hook in self.pre_write_hooks:
            hook(self)
        result = super().write_data(plan, planner)
        if not self.is_coordinator:
            result.wait()
            for hook in self.post_write_hooks:
                hook(self)
        return result

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        for hook in self.post_write_hooks:
            hook(self)
