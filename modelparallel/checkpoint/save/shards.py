"""Streamed safetensors shards: the layout is planned from shapes first, then tensors are appended.

A safetensors file starts with a header giving every tensor's offsets, so a writer normally
needs all tensors before writing the first byte. Every key, dtype and shape of an export is
known before any tensor is gathered (global shapes are metadata), so ``plan_shards`` fixes the
files, headers and offsets up front and ``ShardWriter`` then writes each tensor's bytes the
moment it arrives and forgets it: the writer never holds more than the tensor in hand.

Files are named as Hugging Face names them: one ``{prefix}.safetensors``, or
``{prefix}-00001-of-0000N.safetensors`` plus ``{prefix}.safetensors.index.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...host_bytes import host_bytes
from ...materialize.safetensors_io import DTYPE_NAMES
from ..safety.commit import crc32
from .stream import named


@dataclass
class Shard:
    name: str
    entries: dict[str, dict] = field(default_factory=dict)  # key -> safetensors header entry
    size: int = 0


def _nbytes(shape, dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def plan_shards(items: list[tuple[str, tuple[int, ...], torch.dtype]], prefix: str, max_bytes: int) -> list[Shard]:
    """Assign (key, shape, dtype) items, in order, to shards of at most ``max_bytes`` (a tensor
    larger than that gets a shard of its own) and fix every header entry."""
    shards = [Shard("")]
    for key, shape, dtype in items:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"{key}: dtype {dtype} cannot be stored in safetensors")
        n = _nbytes(shape, dtype)
        if shards[-1].entries and shards[-1].size + n > max_bytes:
            shards.append(Shard(""))
        s = shards[-1]
        s.entries[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [s.size, s.size + n]}
        s.size += n
    for i, s in enumerate(shards):
        s.name = f"{prefix}.safetensors" if len(shards) == 1 else \
            f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    return shards


def _header(shard: Shard, metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header, space-padded to a multiple of 8 (as safetensors does)."""
    raw = json.dumps({"__metadata__": metadata, **shard.entries}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Write planned shards into ``directory``, one tensor at a time, in plan order."""

    def __init__(self, directory: Path, shards: list[Shard], metadata: dict[str, str] | None = None):
        self.directory, self.shards = directory, shards
        self.metadata = {"format": "pt", **(metadata or {})}
        self._where = {key: i for i, s in enumerate(shards) for key in s.entries}
        self._open: tuple[int, object] | None = None
        self._written: set[str] = set()
        self._crc = [0] * len(shards)  # CRC32 of every byte written: no re-read to checksum the shards

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append ``key``'s bytes; its dtype and shape must be what the plan said."""
        index = self._where[key]
        entry = self.shards[index].entries[key]
        if DTYPE_NAMES.get(tensor.dtype) != entry["dtype"] or list(tensor.shape) != entry["shape"]:
            raise ValueError(f"{key}: got {tensor.dtype} {tuple(tensor.shape)}, planned {entry['dtype']} "
                             f"{tuple(entry['shape'])}")
        f = self._file(index)
        if f.tell() - self._data_start != entry["data_offsets"][0]:
            raise ValueError(f"{key}: written out of plan order")
        data = host_bytes(tensor.detach().cpu().contiguous())
        try:
            f.write(data)
        except OSError as e:
            raise named(e, self.directory / self.shards[index].name) from None
        self._crc[index] = crc32(data, self._crc[index])
        self._written.add(key)

    def _file(self, index: int):
        if self._open is not None and self._open[0] == index:
            return self._open[1]
        self._close_current()
        path = self.directory / self.shards[index].name
        header = _header(self.shards[index], self.metadata)
        try:
            f = open(path, "wb")
            f.write(header)
        except OSError as e:
            raise named(e, path) from None
        self._crc[index] = crc32(header)
        self._data_start = len(header)
        self._open = (index, f)
        return f

    def _close_current(self) -> None:
        if self._open is not None:
            index, f = self._open
            self._open = None
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                raise named(e, self.directory / self.shards[index].name) from None
            finally:
                with contextlib.suppress(OSError):
                    f.close()

    def checksums(self) -> dict[str, dict]:
        """``{file: {"size", "crc32"}}`` of the shards, as ``commit.file_checksum`` would compute."""
        return {s.name: {"size": self._data_start_of(s) + s.size, "crc32": f"{crc:08x}"}
                for s, crc in zip(self.shards, self._crc)}

    def _data_start_of(self, shard: Shard) -> int:
        return len(_header(shard, self.metadata))

    def close(self, prefix: str) -> list[str]:
        """Finish the last shard and write the index (several shards); returns the file names."""
        self._close_current()
        unwritten = [k for k in self._where if k not in self._written]
        if unwritten:
            raise ValueError(f"planned tensors never written: {unwritten[:10]}")
        names = [s.name for s in self.shards]
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(s.size for s in self.shards)},
                     "weight_map": {k: s.name for s in self.shards for k in s.entries}}
            path = self.directory / f"{prefix}.safetensors.index.json"
            path.write_text(json.dumps(index, indent=2, sort_keys=True))
            names.append(path.name)
        return names
