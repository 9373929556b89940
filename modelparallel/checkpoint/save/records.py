"""``torch.save``'s bytes for a tensor, without serializing every tensor again.

``torch.save`` of one tensor writes a small zip: a pickle naming the tensor's dtype, shape and
strides, a few constant records, the tensor's bytes stored uncompressed and aligned, and the
zip's directory. With the zip's CRC-32 off, every byte but the tensor's own depends only on
that signature. So ``TensorRecords`` makes the bytes before and after the tensor's once per
signature (a ``torch.save`` under ``skip_data``, which leaves a hole where the bytes go) and
writes every tensor of that signature as those bytes with its own memory in between: the very
file ``torch.save`` writes (the tests compare them byte for byte), without its per-call pickler
class, its pickling and its forty small writes, which cost a partial save of a medium model
about a quarter of a second per rank.

Anything else (zip CRC on, a tensor subclass, a nested or sparse tensor, a view of a larger
storage, gradients, conjugate or negative bits) is written by ``torch.save`` itself.
"""

from __future__ import annotations

import io

import torch
from torch.serialization import get_crc32_options, skip_data

from ...compat import get_tensor_metadata, storage_alignment
from ...host_bytes import host_bytes


class _Sink(io.RawIOBase):
    """A file object that keeps what ``torch.save`` writes and where it skips (``skip_data``
    seeks over each storage's bytes)."""

    def __init__(self):
        super().__init__()
        self.pos = 0
        self.pieces: list[tuple[int, bytes]] = []
        self.holes: list[tuple[int, int]] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.pieces.append((self.pos, bytes(view)))
        self.pos += len(view)
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_CUR or offset < 0:
            raise io.UnsupportedOperation("only forward skips")
        self.holes.append((self.pos, offset))
        self.pos += offset
        return self.pos

    def tell(self) -> int:
        return self.pos


def signature(tensor: torch.Tensor) -> tuple | None:
    """What ``torch.save``'s bytes around ``tensor``'s data depend on, or None when they may
    depend on more (or on the data itself: the zip's CRC-32 is on)."""
    if (type(tensor) is not torch.Tensor or tensor.is_nested or tensor.device.type != "cpu"
            or tensor.layout != torch.strided or tensor.requires_grad or tensor.is_conj() or tensor.is_neg()
            or tensor.is_quantized or tensor.storage_offset() != 0
            or tensor.untyped_storage().nbytes() != tensor.nbytes or not tensor.is_contiguous()
            or tensor.__dict__ or get_tensor_metadata(tensor) or get_crc32_options()):
        return None
    return tensor.dtype, tuple(tensor.shape), tensor.stride(), storage_alignment()


def _around(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The bytes ``torch.save`` writes before and after ``tensor``'s data (None: not one hole of
    exactly its size, so not the layout this module relies on)."""
    sink = _Sink()
    with skip_data():
        torch.save(tensor, sink)
    data = b"".join(piece for _, piece in sink.pieces)
    if tensor.nbytes == 0:
        return (data, b"") if not sink.holes else None
    if len(sink.holes) != 1 or sink.holes[0][1] != tensor.nbytes:
        return None
    start = sink.holes[0][0]
    head = sum(len(piece) for pos, piece in sink.pieces if pos < start)
    return data[:head], data[head:]


class TensorRecords:
    """Writes tensors as ``torch.save`` does, its bytes around the data made once per
    signature (kept for the life of this object: one save)."""

    def __init__(self):
        self._around: dict[tuple, tuple[bytes, bytes] | None] = {}

    def write(self, tensor: torch.Tensor, stream) -> None:
        key = signature(tensor)
        if key is not None and key not in self._around:
            self._around[key] = _around(tensor)
        around = self._around.get(key) if key is not None else None
        if around is None:
            torch.save(tensor, stream)
            return
        head, tail = around
        stream.write(head)
        if tensor.nbytes:
            stream.write(host_bytes(tensor if tensor.is_contiguous() else tensor.contiguous()))
        stream.write(tail)
