"""DCP reads straight into the live tensors when the layout did not change.

``torch.distributed.checkpoint``'s ``FileSystemReader`` loads every stored chunk with
``torch.load``: a fresh tensor is allocated (page faults on memory the process already holds
once), filled, and then copied into the model's tensor. When a chunk is exactly the slice the
loading rank needs (same TP/DP layout as at save time, the common resume), the bytes on disk are
already the tensor's row-major bytes, so they can be read directly into the destination with one
``preadv``: no allocation, one copy instead of two. That saving pays for checksum verification
and more (see ``bench/bench_checkpoint.py``).

The bytes are found through the chunk's own zip directory (``torch.save`` writes a zip whose
tensor record is stored uncompressed), with the standard ``zipfile`` module. Only checkpoints
written with ``ContiguousSavePlanner`` take this path: it guarantees every tensor was stored
contiguous from offset 0, which the zip directory alone cannot tell. Anything else (resharding,
a dtype change, a non-contiguous or non-CPU destination, non-tensor entries) goes through
DCP's own reader unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
import sys
import zipfile
from concurrent.futures import Future

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

_STORAGE_RECORD = re.compile(r"(^|/)data/\d+$")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, 22 bytes we skip, name and extra lengths
_BLOCK = 1 << 26  # one preadv is capped by Linux at ~2 GiB; 64 MiB keeps each call well under


class ContiguousSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that every tensor is written contiguous (DCP keeps a
    dense tensor's strides). The files stay plain DCP checkpoints that any DCP reader loads."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data.contiguous() if isinstance(data, torch.Tensor) else data


class _Window:
    """A read-only file-like view of ``length`` bytes at ``start`` of a descriptor (what
    ``zipfile`` needs to read one chunk's directory)."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise OSError(f"seek before the start of a {self.length}-byte chunk")
        self.pos = base + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, max(self.length - self.pos, 0))
        data = os.pread(self.fd, n, self.start + self.pos)
        self.pos += len(data)
        return data


def _data_range(fd: int, start: int, length: int, nbytes: int) -> int | None:
    """Absolute offset of the tensor bytes inside the ``torch.save`` zip at ``start``, or None
    if the chunk is not one stored, little-endian record of exactly ``nbytes`` bytes."""
    try:
        with zipfile.ZipFile(_Window(fd, start, length)) as archive:
            infos = archive.infolist()
            records = [i for i in infos if _STORAGE_RECORD.search(i.filename)]
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            if order and archive.read(order[0]).strip() != sys.byteorder.encode():
                return None
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or records[0].file_size != nbytes:
        return None
    info = records[0]
    header = os.pread(fd, _LOCAL_HEADER.size, start + info.header_offset)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        return None
    return start + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def _read_into(fd: int, offset: int, target: torch.Tensor, path: str) -> None:
    """Fill the contiguous CPU ``target`` with the bytes at ``offset`` (short reads retried)."""
    view = memoryview(target.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + _BLOCK]], offset + done)
        if got <= 0:
            raise OSError(f"{path}: ended {len(view) - done} bytes early at offset {offset + done}")
        done += got


class FastReader(FileSystemReader):
    """``FileSystemReader`` with the direct path described in the module docstring for chunks
    that map one-to-one onto a destination; every other item is left to DCP."""

    def __init__(self, path, contiguous: bool):
        super().__init__(path)
        self.contiguous = contiguous

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rest = [req for req in plan.items if not self._read_direct(req, planner)] \
            if self.contiguous else plan.items
        return super().read_data(dataclasses.replace(plan, items=rest), planner)

    def _read_direct(self, req: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``req`` into its destination and commit it; False (nothing done) if it does not
        map one-to-one onto a contiguous CPU destination of the saved dtype."""
        if req.type != LoadItemType.TENSOR or any(req.storage_offsets):
            return False
        target = planner.resolve_tensor(req).detach()
        saved = getattr(planner, "metadata", None)
        saved = saved.state_dict_metadata.get(req.storage_index.fqn) if saved is not None else None
        if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0 \
                or getattr(getattr(saved, "properties", None), "dtype", None) != target.dtype:
            return False
        info = self.storage_data[req.storage_index]
        if getattr(info, "transform_descriptors", None):
            return False
        path = str(self.fs.concat_path(self.path, info.relative_path))
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = _data_range(fd, info.offset, info.length, target.numel() * target.element_size())
            if offset is None:
                return False
            _read_into(fd, offset, target, path)
        finally:
            os.close(fd)
        planner.commit_tensor(req, target)
        return True
