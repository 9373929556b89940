"""What DCP's ``.metadata`` must say before a load plans from it.

The allow-list unpickler builds only DCP's own classes, but their fields come from the file: a
``.metadata`` can hold a dict where ``Metadata`` belongs, a string for a byte offset, or
chunks that do not cover their tensor. DCP plans reads from the chunks, and a region no chunk
covers is simply not read: the load's fresh copy keeps what uninitialized memory held there and
then replaces the model's values with it. So every tensor's chunks must tile it exactly (inside
it, not overlapping, their volumes adding up to its own), and every field must have its type,
before anything is planned; a problem is reported naming the entry.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorStorageMetadata)

from ...compat import StorageInfo

_ROWS = 1024
"""Chunks compared with all the others at once when checking that they do not overlap."""


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(value, ndim: int | None = None) -> bool:
    return isinstance(value, torch.Size) and all(_count(v) for v in value) and (ndim is None or len(value) == ndim)


def _chunk_problem(fqn: str, md: TensorStorageMetadata) -> str | None:
    """None if ``md``'s chunks tile its tensor exactly, else what is wrong."""
    size = md.size
    if not _shape(size) or not isinstance(getattr(md.properties, "dtype", None), torch.dtype) \
            or not isinstance(md.chunks, list):
        return f"tensor {fqn!r}: its size, dtype or chunk list is malformed"
    boxes = []
    for chunk in md.chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not _shape(chunk.offsets, len(size)) \
                or not _shape(chunk.sizes, len(size)):
            return f"tensor {fqn!r}: a chunk that is not offsets and sizes of its {len(size)} dimensions"
        if math.prod(chunk.sizes) == 0:
            continue
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, size)):
            return (f"tensor {fqn!r}: chunk at {tuple(chunk.offsets)} of {tuple(chunk.sizes)} passes its size "
                    f"{tuple(size)}")
        boxes.append((chunk.offsets, chunk.sizes))
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(size):
        return f"tensor {fqn!r}: its chunks hold {covered} elements, its size {tuple(size)} has {math.prod(size)}"
    if len(boxes) > 1 and _overlap(boxes):
        return f"tensor {fqn!r}: its chunks overlap (so some of it is not covered)"
    return None


def _overlap(boxes: list) -> bool:
    """Whether any two boxes (offsets, sizes) share an element."""
    lo = torch.tensor([o for o, _ in boxes], dtype=torch.int64).reshape(len(boxes), -1)
    hi = lo + torch.tensor([s for _, s in boxes], dtype=torch.int64).reshape(len(boxes), -1)
    for first in range(0, len(boxes), _ROWS):
        a_lo, a_hi = lo[first:first + _ROWS, None], hi[first:first + _ROWS, None]
        hits = ((a_lo < hi[None]) & (lo[None] < a_hi)).all(-1)
        rows = torch.arange(hits.shape[0])
        hits[rows, rows + first] = False  # a box with itself
        if hits.any():
            return True
    return False


def metadata_problems(metadata) -> list[str]:
    """Everything that keeps ``metadata`` (unpickled from a ``.metadata`` file) from describing
    a checkpoint; empty if a load may plan from it."""
    if not isinstance(metadata, Metadata):
        return [f"it holds {type(metadata).__name__}, not DCP's Metadata"]
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        return ["its state_dict_metadata is not a dict of entry names"]
    if not isinstance(storage, dict):
        return ["its storage_data (where each entry is stored) is not a dict"]
    if not (metadata.storage_meta is None or isinstance(metadata.storage_meta, StorageMeta)):
        return [f"its storage_meta is a {type(metadata.storage_meta).__name__}"]
    problems = []
    for fqn, md in entries.items():
        if isinstance(md, TensorStorageMetadata):
            problems += [p] if (p := _chunk_problem(fqn, md)) else []
        elif not isinstance(md, BytesStorageMetadata):
            problems.append(f"entry {fqn!r}: {type(md).__name__} is neither a tensor nor an object")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) \
                or not (index.offset is None or _shape(index.offset)) \
                or not (index.index is None or _count(index.index)):
            problems.append(f"a storage key {type(index).__name__} is not an entry name and offset")
        elif not isinstance(info, StorageInfo) or not isinstance(info.relative_path, str) \
                or not _count(info.offset) or not _count(info.length):
            problems.append(f"entry {index.fqn!r}: its storage is not a file name, offset and length")
    return problems
