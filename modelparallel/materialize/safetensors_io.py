"""Read a contiguous block of a safetensors tensor straight into an existing tensor.

``safe_open(...).get_slice`` memory-maps the file and returns a new tensor: the block exists
twice (mapped pages and the copy) before it reaches the model. When a rank's block is one
contiguous byte range of the file (a row shard such as a column-parallel weight or a vocabulary
shard, or a whole replicated tensor) and the dtypes agree, this reads the range with one
``readinto`` into the destination's own memory: no map, no copy. Other blocks (column shards,
packed chunks, dtype casts) return False and the caller uses ``get_slice``.

The format: 8 bytes little-endian header length, a JSON header (per tensor ``dtype``, ``shape``,
``data_offsets`` relative to the end of the header), then the data, C-contiguous.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import struct
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..host_bytes import host_bytes

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
"""Safetensors dtype name -> torch dtype: the dtypes this package reads and writes."""
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
"""Torch dtype -> safetensors dtype name."""


def header(path: str) -> tuple[int, dict]:
    """(byte where the data starts, the JSON header) of a safetensors file. Cached by path,
    size, mtime, ctime and inode: a file rewritten in place (even at the same path) is re-read,
    never served from the old header's offsets.

    Raises:
        ValueError: naming the file, if its header is truncated or not JSON.
    """
    st = os.stat(path)
    return _header(str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@functools.lru_cache(maxsize=64)
def _header(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> tuple[int, dict]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: safetensors header of {n} bytes in a {size}-byte file (truncated?)")
        try:
            return 8 + n, json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from e


@contextlib.contextmanager
def open_file(path: str) -> Iterator:
    """``safe_open(path)`` whose failures name the file: safetensors' own errors ("incomplete
    metadata, file not fully covered") do not say which of a checkpoint's files is damaged.

    Raises:
        ValueError: naming the file, if it is not a complete safetensors file.
        OSError: of the same type (``FileNotFoundError``...), naming the file, if it cannot be opened.
    """
    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: not a complete safetensors file ({e})") from None
    except OSError as e:
        raise type(e)(f"{path}: {e.strerror or e}") from None
    with handle:
        yield handle


def load_all(path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (``safetensors.torch.load_file``), through ``open_file``
    so a damaged file is named in the error."""
    with open_file(path) as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def contiguous_range(shape: tuple[int, ...], offset: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, int] | None:
    """(first element, element count) if the block is one contiguous run of the C-contiguous
    ``full`` tensor, else None."""
    partial = [d for d in range(len(full)) if shape[d] != full[d]]
    if partial:
        k = partial[0]
        if any(shape[d] != 1 for d in range(k)) or any(shape[d] != full[d] for d in range(k + 1, len(full))):
            return None
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    return sum(o * s for o, s in zip(offset, strides)), math.prod(shape)


def read_into(path: str, key: str, dst: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...]) -> bool:
    """Fill contiguous CPU tensor ``dst`` with block (``shape`` at ``offset``) of tensor ``key``;
    False (nothing read) if the block is not one byte range or the dtypes differ."""
    start, meta = header(path)
    info = meta[key]
    if DTYPES.get(info["dtype"]) != dst.dtype or dst.device.type != "cpu" or not dst.is_contiguous():
        return False
    run = contiguous_range(tuple(shape), tuple(offset), tuple(info["shape"]))
    if run is None or run[1] != dst.numel():
        return False
    if run[1] == 0:
        return True
    fd = os.open(path, os.O_RDONLY)
    try:
        read_exact_into(fd, start + info["data_offsets"][0] + run[0] * dst.element_size(), dst, f"{path} ({key})")
    finally:
        os.close(fd)
    return True


READ_BLOCK = 1 << 26
"""Bytes per ``preadv``: Linux caps one call at about 2 GiB; 64 MiB keeps each call well under."""


def read_exact_into(fd: int, offset: int, dst: torch.Tensor, what: str) -> None:
    """Fill the contiguous CPU tensor ``dst`` with the bytes of open file ``fd`` at ``offset``
    (short reads retried), straight into ``dst``'s memory.

    Raises:
        OSError: naming ``what`` and the offset, if the file ends first.
    """
    view = host_bytes(dst)
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + READ_BLOCK]], offset + done)
        if got <= 0:
            raise OSError(f"{what}: ended {len(view) - done} bytes early at offset {offset + done}")
        done += got
