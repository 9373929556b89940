"""``checkpoint.crc``: a file checksummed in pieces on threads must give zlib's CRC-32 of the
whole, byte for byte what one pass gives; a short file is reported, not padded."""

from __future__ import annotations

import os
import random
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from modelparallel.checkpoint.safety import crc


def test_combine_equals_zlib_over_the_concatenation():
    rng = random.Random(0)
    for _ in range(300):
        a = rng.randbytes(rng.randrange(0, 200))
        b = rng.randbytes(rng.choice([0, 1, 3, 8, rng.randrange(0, 70000)]))
        assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 4 KiB, so a small file is read on several threads."""
    monkeypatch.setattr(crc, "PIECE", 4096)
    monkeypatch.setattr(crc, "_SHIFT_PIECE", crc._shift(4096))


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_read_hashed_equals_one_pass(tmp_path, small_pieces, threads):
    data = random.Random(1).randbytes(10 * 4096 + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(threads) if threads else None
    try:
        for offset, n in [(0, len(data)), (1, len(data) - 1), (4095, 3 * 4096), (77, 10)]:
            buf = bytearray(n)
            got_crc, got = crc.read_hashed(fd, memoryview(buf), offset, zlib.crc32(data[:offset]), pool)
            assert (got, bytes(buf)) == (n, data[offset:offset + n])
            assert got_crc == zlib.crc32(data[:offset + n])
        buf = bytearray(len(data) + 5 * 4096)  # asks past the end: the bytes that exist, counted
        got_crc, got = crc.read_hashed(fd, memoryview(buf), 0, 0, pool)
        assert got == len(data) and got_crc == zlib.crc32(data)
    finally:
        os.close(fd)
        if pool:
            pool.shutdown()
