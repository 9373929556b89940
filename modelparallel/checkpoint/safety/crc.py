"""CRC-32 for checkpoint files: the one place the implementation is chosen, and the arithmetic
that lets a large read be checksummed in pieces on several threads.

A checkpoint's manifest records one CRC-32 per file. Computing it over a file read front to back
is one core's work (about 2.7 GB/s with zlib), which made resuming a large checkpoint slower than
reading it. CRC-32 is linear over GF(2), so the checksum of ``a + b`` follows from the checksums
of ``a`` and ``b`` and the length of ``b`` alone (``combine``): pieces read and hashed on
different threads (both ``os.preadv`` and ``zlib.crc32`` release the GIL on large buffers) give
exactly the value one pass over the whole file gives.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor, wait

try:  # zlib's CRC-32 with SIMD, same values, about 3x faster (pip install modelparallel[fastcrc])
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32

__all__ = ["crc32", "combine", "read_hashed", "PIECE"]

_POLY = 0xEDB88320
"""CRC-32's generator polynomial, bit-reversed (the bit order zlib's CRC-32 works in)."""

PIECE = 1 << 23
"""Bytes one thread reads and hashes at a time in ``read_hashed``."""


def _mul(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the generator, both in reversed bit order (x^0 is bit 31)."""
    out, bit = 0, 1 << 31
    while a:
        if a & bit:
            out ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return out


def _powers() -> tuple[int, ...]:
    """``x^(2^k)`` modulo the generator for k = 0..31 (the sequence repeats with period 32)."""
    out, p = [], 1 << 30  # x^1
    for _ in range(32):
        out.append(p)
        p = _mul(p, p)
    return tuple(out)


_X_2K = _powers()


def _shift(n_bytes: int) -> int:
    """``x^(8 n_bytes)`` modulo the generator: appending ``n_bytes`` zero bytes to a message
    multiplies its (pre- and post-conditioned) CRC register by this."""
    p, k, n = 1 << 31, 3, n_bytes  # x^0; a byte is x^8 = x^(2^3)
    while n:
        if n & 1:
            p = _mul(_X_2K[k & 31], p)
        n >>= 1
        k += 1
    return p


_SHIFT_PIECE = _shift(PIECE)


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    return _mul(_SHIFT_PIECE if len_b == PIECE else _shift(len_b), crc_a) ^ crc_b


def _read_piece(fd: int, view: memoryview, offset: int, crc: int = 0) -> tuple[int, int]:
    """Fill ``view`` from ``fd`` at ``offset``: (``crc`` extended over the bytes read, bytes
    read). Fewer bytes than asked means the file ended there."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return crc32(view[:done], crc), done


def read_hashed(fd: int, view: memoryview, offset: int, crc: int, pool: Executor | None) -> tuple[int, int]:
    """Fill ``view`` (bytes) from ``fd`` at ``offset`` and extend ``crc`` over it: (new CRC, bytes
    read). With a ``pool``, pieces of ``PIECE`` bytes are read and hashed on its threads and
    their checksums combined in order; the result equals a single pass. Fewer bytes than asked
    means the file ended (the caller reports it); OSError propagates."""
    if pool is None or len(view) <= PIECE:
        return _read_piece(fd, view, offset, crc)
    starts = range(0, len(view), PIECE)
    futures = [pool.submit(_read_piece, fd, view[s:s + PIECE], offset + s) for s in starts]
    wait(futures)  # all of them, also when one failed: no thread writes into view after the return
    total, short = 0, False
    for s, future in zip(starts, futures):
        piece_crc, done = future.result()
        if short:
            continue
        crc, total = combine(crc, piece_crc, done), total + done
        short = done < min(PIECE, len(view) - s)
    return crc, total
