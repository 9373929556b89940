"""DCP's storage reader for our checkpoints: every file verified while it is read, chunks read
straight into their destination when the layout did not change.

``torch.distributed.checkpoint``'s ``FileSystemReader`` opens the files DCP's metadata names (any
path: ``../x``, a FIFO) and loads each stored chunk with ``torch.load`` into a fresh tensor that
is then copied into the destination. ``FastReader`` instead goes through the checkpoint's
manifest (``files.CheckpointFiles``): it opens only listed regular files, without following
links, reads each file once from front to back through one descriptor, hashing every byte, and
raises naming the file if size or CRC32 differ from the manifest when the file is done. The
destinations are the caller's staging tensors (nothing live changes until every rank read and
verified everything).

When a chunk maps one-to-one onto a contiguous destination of the saved dtype (same TP/DP
layout as at save time, the common resume), its bytes are read straight into the destination:
no allocation, one copy (a destination on a GPU: into one reused pinned host buffer, then one
copy to the device). A file is read and checksummed in pieces on several threads
(``crc.read_hashed``), so a resume is not held to one core's CRC-32 speed. The tensor's bytes are found through the zip directory at the end of
the chunk (``torch.save`` writes a zip whose tensor record is stored uncompressed), read ahead
and hashed when the read reaches it. Only checkpoints written with ``save.planner.ContiguousSavePlanner``
take this path: it guarantees every tensor was stored contiguous from offset 0, which the zip
directory alone cannot tell. Anything else (resharding, a dtype change, non-tensor entries) is
read whole and loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import struct
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ... import cpus
from ...compat import set_element
from ...host_bytes import host_bytes
from ..safety.files import CheckpointFiles, CorruptFileError, UnsafeCheckpointError, VerifiedReader
from ..safety.safe_load import torch_load

# zip structures, fields we do not use skipped: local file header (signature, name and extra
# lengths), central directory entry (signature, method, sizes, name/extra/comment lengths, local
# header offset) and end of central directory (signature, entries, directory size and offset)
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_CENTRAL = struct.Struct("<4s6xH8xIIHHH8xI")
_END = struct.Struct("<4s6xHII2x")
_TAIL = 1 << 14  # torch.save's central directory and end records are well under 2 KiB
READ_THREADS = 8
"""At most this many threads read and checksum one rank's files (fewer on fewer cores)."""


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


def _records(tail: bytes, length: int) -> dict[str, tuple[int, int, int]] | None:
    """``name -> (method, size, local header offset)`` from the zip central directory in
    ``tail`` (the last bytes of a chunk of ``length`` bytes), or None if it is not a plain
    (non-zip64) zip ending there."""
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + _END.size > len(tail):
        return None
    _, count, cd_size, cd_offset = _END.unpack_from(tail, end)
    first = len(tail) - (length - cd_offset)
    if cd_offset == 0xFFFFFFFF or not 0 <= first <= end or first + cd_size > end:
        return None
    out, pos = {}, first
    for _ in range(count):
        if pos + _CENTRAL.size > end:
            return None
        signature, method, csize, usize, name_len, extra_len, comment_len, local = _CENTRAL.unpack_from(tail, pos)
        if signature != b"PK\x01\x02" or csize != usize or 0xFFFFFFFF in (csize, local):
            return None
        name = tail[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len].decode("utf-8", "replace")
        out[name] = (method, usize, local)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return out


def _data_layout(tail: bytes, length: int, nbytes: int) -> tuple[int, int] | None:
    """(local header offset of the tensor record, of the byteorder record) inside a chunk, or
    None if the chunk is not what the direct path expects: one stored record ``data/N`` of
    exactly ``nbytes`` bytes, little-endian, the byteorder record before the data. Anything
    unusual (zip64, compression, another writer) returns None and the chunk is read whole."""
    records = _records(tail, length)
    if records is None:
        return None
    storage = [r for name, r in records.items() if name.rpartition("/data/")[2].isdigit() and "/data/" in name]
    order = [r for name, r in records.items() if name.endswith("/byteorder")]
    if len(storage) != 1 or len(order) != 1 or storage[0][:2] != (0, nbytes) or sys.byteorder != "little" \
            or order[0][2] >= storage[0][2]:
        return None
    return storage[0][2], order[0][2]


def _payload(head: bytes, local: int) -> int | None:
    """Offset of a record's bytes after its local header at ``local`` in ``head``."""
    if local + _LOCAL_HEADER.size > len(head):
        return None
    signature, name_len, extra_len = _LOCAL_HEADER.unpack_from(head, local)
    return local + _LOCAL_HEADER.size + name_len + extra_len if signature == b"PK\x03\x04" else None


def _read_into(reader: VerifiedReader, target: torch.Tensor, host: torch.Tensor | None = None) -> None:
    """Fill the contiguous ``target`` with the reader's next bytes (one seam, so a test can
    watch which reads take the direct path). A ``target`` off the CPU is filled through
    ``host``, a CPU byte buffer of its size (pinned for CUDA), in one copy."""
    raw = target.view(-1).view(torch.uint8)
    if target.device.type == "cpu":
        reader.read_into(host_bytes(target))
        return
    reader.read_into(host_bytes(host))
    raw.copy_(host)


def _threads() -> int:
    """Threads one rank's load reads and checksums with: reading from the page cache and CRC-32
    are both one core's work per thread."""
    return max(1, min(READ_THREADS, cpus.usable()))


class _HostBuffer:
    """One CPU byte buffer reused for every chunk a load reads on its way to a device: grown to
    the largest chunk, pinned for CUDA so the copy runs at the link's speed."""

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None
            self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        return self.buf[:nbytes]


def _check_stored(tensor: torch.Tensor, req: ReadItem, planner: LoadPlanner, where: str) -> None:
    """A stored chunk must be what the metadata (which the plan checked) says: its dtype, and
    room for the piece read from it. A chunk that lies would otherwise be cast into an fp32
    slot silently, or fail in ``narrow`` with a message naming neither file nor key.

    Raises:
        CorruptFileError: naming ``where`` (the file and the entry).
    """
    saved = planner.metadata.state_dict_metadata.get(req.storage_index.fqn)
    dtype = getattr(getattr(saved, "properties", None), "dtype", None)
    fits = tensor.dim() == len(req.lengths) and all(
        o + n <= s for o, n, s in zip(req.storage_offsets, req.lengths, tensor.shape))
    if not fits or (dtype is not None and tensor.dtype != dtype):
        raise CorruptFileError(f"{where}: holds {tuple(tensor.shape)} {tensor.dtype}, its metadata says {dtype} "
                               f"with {tuple(req.lengths)} at {tuple(req.storage_offsets)}")


class FastReader(FileSystemReader):
    """DCP storage reader of one part of a committed checkpoint: verified reads through the
    manifest, direct reads where a chunk maps one-to-one (see the module docstring)."""

    def __init__(self, files: CheckpointFiles, part: str, contiguous: bool):
        super().__init__(files.directory / part)
        self.files, self.part, self.contiguous = files, part, contiguous
        self._host = _HostBuffer()

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = self.files.metadata(self.part)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, dict[tuple[int, int], list[ReadItem]]] = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise CorruptFileError(f"{self.path / '.metadata'}: entry {item.storage_index.fqn!r} has a chunk at "
                                       f"{tuple(item.storage_index.offset or ())} but no storage record for it")
            if getattr(info, "transform_descriptors", None):
                raise UnsafeCheckpointError(f"{self.path}: entry {item.storage_index.fqn!r} was written with storage "
                                            f"transforms {info.transform_descriptors}, which this reader does not apply")
            rel = f"{self.part}/{info.relative_path}" if self.part and isinstance(info.relative_path, str) \
                else info.relative_path
            self.files.entry(rel)  # listed, or refused naming it: DCP's metadata may name any path
            by_file.setdefault(rel, {}).setdefault((info.offset, info.length), []).append(item)
        with ThreadPoolExecutor(_threads(), thread_name_prefix="checkpoint-reader") as pool:
            for rel in sorted(by_file):
                with self.files.reader(rel, pool) as reader:
                    for (offset, length), reqs in sorted(by_file[rel].items()):
                        if offset + length > reader.entry["size"]:  # before any memory is taken for it
                            raise CorruptFileError(f"{reader.path}: entry {reqs[0].storage_index.fqn!r} at byte "
                                                   f"{offset}, {length} bytes, passes its end "
                                                   f"({reader.entry['size']} bytes)")
                        reader.skip_to(offset)
                        self._read_chunk(reader, length, reqs, planner)
                    reader.finish()
        self._host.buf = None  # a pinned buffer is not kept past the load
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_chunk(self, reader: VerifiedReader, length: int, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        start = reader.pos
        prefix = self._read_direct(reader, length, reqs[0], planner) if len(reqs) == 1 else b""
        if prefix is None:
            return
        whole = bytearray(length)
        whole[:len(prefix)] = prefix
        reader.read_into(memoryview(whole)[len(prefix):])
        data = io.BytesIO(whole)
        tensor = None
        for req in reqs:
            data.seek(0)
            if req.type == LoadItemType.BYTE_IO:
                try:
                    planner.load_bytes(req, data)
                except (UnsafeCheckpointError, CorruptFileError) as e:  # the entry's error, with its file
                    raise type(e)(f"{reader.path}: {e}") from e
                continue
            if tensor is None:
                tensor = torch_load(data, name=f"{reader.path} (entry {req.storage_index.fqn!r} at byte {start})")
            _check_stored(tensor, req, planner, f"{reader.path}: entry {req.storage_index.fqn!r} at byte {start}")
            piece = tensor
            for dim, (offset, size) in enumerate(zip(req.storage_offsets, req.lengths)):
                piece = piece.narrow(dim, offset, size)
            target = planner.resolve_tensor(req).detach()
            if target.size() != piece.size():
                raise CorruptFileError(f"{reader.path}: entry {req.storage_index.fqn!r} holds {tuple(piece.shape)}, "
                                       f"its metadata says {tuple(target.shape)}")
            target.copy_(piece)
            planner.commit_tensor(req, target)

    def _read_direct(self, reader: VerifiedReader, length: int, req: ReadItem, planner: LoadPlanner):
        """Read ``req`` straight into its destination and commit it: None when done, else the
        bytes of the chunk already consumed (the caller reads the rest and loads it whole)."""
        if not self.contiguous or req.type != LoadItemType.TENSOR or any(req.storage_offsets):
            return b""
        target = planner.resolve_tensor(req).detach()
        saved = planner.metadata.state_dict_metadata.get(req.storage_index.fqn)
        if not target.is_contiguous() or target.numel() == 0 \
                or getattr(getattr(saved, "properties", None), "dtype", None) != target.dtype \
                or tuple(req.lengths) != tuple(target.shape):
            return b""
        nbytes = target.numel() * target.element_size()
        start = reader.pos
        tail = reader.prefetch(start + length - min(length, _TAIL), min(length, _TAIL))
        layout = _data_layout(tail, length, nbytes)
        if layout is None:
            return b""
        data_header, order_header = layout
        head = reader.read(data_header + _LOCAL_HEADER.size)
        data_at, order_at = _payload(head, data_header), _payload(head, order_header)
        if data_at is None or order_at is None or order_at + 6 > data_header:
            raise CorruptFileError(f"{reader.path}: chunk of {req.storage_index.fqn!r} at byte {start}: its zip "
                                   "headers do not match its directory (damaged)")
        head += reader.read(data_at - len(head))
        if bytes(head[order_at:order_at + 6]) != b"little" or data_at + nbytes > length:
            return head
        _read_into(reader, target, None if target.device.type == "cpu" else self._host.take(nbytes, target.device))
        planner.commit_tensor(req, target)
        return None
