"""DCP reads straight into the live tensors when the layout did not change.

``torch.distributed.checkpoint``'s ``FileSystemReader`` loads every stored chunk with
``torch.load``: a fresh tensor is allocated (page faults on memory the process already holds
once), filled, and then copied into the model's tensor. When a chunk is exactly the slice the
loading rank needs (same TP/DP layout as at save time, the common resume), the bytes on disk are
already the tensor's row-major bytes, so they can be read directly into the destination with one
``preadv``: no allocation, one copy instead of two. That saving pays for checksum verification
and more (see ``bench/bench_checkpoint.py``).

The bytes are found through the zip directory at the end of the chunk (``torch.save`` writes a
zip whose tensor record is stored uncompressed), read with two small ``pread``s. Only checkpoints
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
from concurrent.futures import Future

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..compat import set_element
from ..materialize.safetensors_io import read_exact_into
from .safe_load import read_dcp_metadata, torch_load

_STORAGE_RECORD = re.compile(r"(^|/)data/\d+$")
# zip structures, fields we do not use skipped: local file header (signature, name and extra
# lengths), central directory entry (signature, method, sizes, name/extra/comment lengths, local
# header offset) and end of central directory (signature, entries, directory size and offset)
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_CENTRAL = struct.Struct("<4s6xH8xIIHHH8xI")
_END = struct.Struct("<4s6xHII2x")
_TAIL = 1 << 14  # torch.save's central directory and end records are well under 2 KiB


class ContiguousSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that every tensor is written contiguous (DCP keeps a
    dense tensor's strides). The files stay plain DCP checkpoints that any DCP reader loads."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data.contiguous() if isinstance(data, torch.Tensor) else data


def _records(fd: int, start: int, length: int) -> dict[str, tuple[int, int, int]] | None:
    """``name -> (method, size, local header offset)`` from the zip central directory at the end
    of the chunk, or None if it is not a plain (non-zip64) zip ending there."""
    tail = os.pread(fd, min(length, _TAIL), start + length - min(length, _TAIL))
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + _END.size > len(tail):
        return None
    _, count, cd_size, cd_offset = _END.unpack_from(tail, end)
    first = len(tail) - (length - cd_offset)
    if cd_offset == 0xFFFFFFFF or not 0 <= first <= end or first + cd_size > end:
        return None
    out, pos = {}, first
    for _ in range(count):
        signature, method, csize, usize, name_len, extra_len, comment_len, local = _CENTRAL.unpack_from(tail, pos)
        if signature != b"PK\x01\x02" or csize != usize or 0xFFFFFFFF in (csize, local):
            return None
        name = tail[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len].decode("utf-8", "replace")
        out[name] = (method, usize, local)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return out


def _data_range(fd: int, start: int, length: int, nbytes: int) -> int | None:
    """Absolute offset of the tensor bytes inside the ``torch.save`` zip at ``start``, or None
    if the chunk is not what the direct path expects: little-endian, one stored record
    ``data/N`` of exactly ``nbytes`` bytes. Anything unusual (zip64, compression, a big-endian
    writer) returns None and DCP's reader takes the chunk."""
    records = _records(fd, start, length)
    if records is None:
        return None
    storage = [r for name, r in records.items() if _STORAGE_RECORD.search(name)]
    order = [r for name, r in records.items() if name.endswith("/byteorder")]
    if len(storage) != 1 or len(order) != 1 or storage[0][:2] != (0, nbytes) or sys.byteorder != "little":
        return None
    data = [_payload(fd, start, r) for r in (order[0], storage[0])]
    if None in data or os.pread(fd, order[0][1], data[0]).strip() != b"little" or data[1] + nbytes > start + length:
        return None
    return data[1]


def _payload(fd: int, start: int, record: tuple[int, int, int]) -> int | None:
    """Absolute offset of a record's bytes: after its local header, whose name and extra field
    lengths may differ from the central directory's."""
    header = os.pread(fd, _LOCAL_HEADER.size, start + record[2])
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    return start + record[2] + _LOCAL_HEADER.size + name_len + extra_len if signature == b"PK\x03\x04" else None


def _read_into(fd: int, offset: int, target: torch.Tensor, path: str) -> None:
    """Fill the contiguous CPU ``target`` with the bytes at ``offset`` (one seam, so a test can
    watch which reads take the direct path)."""
    read_exact_into(fd, offset, target, path)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries (hyperparameters, the loss
    scale) are read with ``weights_only=True``: DCP's own planner unpickles them freely."""

    def load_bytes(self, read_item: ReadItem, value) -> None:
        fqn = read_item.dest_index.fqn
        obj = torch_load(value, name=f"checkpoint entry {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class FastReader(FileSystemReader):
    """``FileSystemReader`` with the direct path described in the module docstring for chunks
    that map one-to-one onto a destination; every other item is left to DCP. The metadata is
    read by a restricted unpickler (``safe_load``), never by plain ``pickle``."""

    def __init__(self, path, contiguous: bool):
        super().__init__(path)
        self.contiguous = contiguous

    def read_metadata(self, *args, **kwargs):
        metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

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
