"""The save's file objects (modelparallel/checkpoint/save/stream.py): write-back started as a file
grows, each range dropped from the page cache only once the disk has it, a failed write-back
raised naming the file.

A failure means a save could drop pages the disk does not have yet (their data would then be
read back from the disk as what it held before), could fill the page cache with the whole
checkpoint again, or could lose a write-back error: the kernel reports it once, to the call that
waits, and a later fsync of the file would then succeed.
"""

import ctypes
import errno
import os
import zlib

import pytest

from modelparallel.checkpoint.save import stream

CHUNK = 1000


class Spy:
    """``sync_file_range`` calls (real ones) and ``posix_fadvise`` calls, in order."""

    def __init__(self, monkeypatch, fail: int | None = None):
        self.calls = []
        real = stream._sync_file_range()
        fadvise = os.posix_fadvise

        def sync_range(fd, start, length, flags):
            self.calls.append(("sync", start, length, flags))
            if fail is not None and flags & stream._WAIT_AFTER:
                ctypes.set_errno(fail)
                return -1
            return real(fd, start, length, flags)

        def drop(fd, start, length, advice):
            self.calls.append(("drop", start, length, advice))
            return fadvise(fd, start, length, advice)

        monkeypatch.setattr(stream, "_sync_file_range", lambda: sync_range)
        monkeypatch.setattr(stream.os, "posix_fadvise", drop)
        monkeypatch.setattr(stream, "SYNC_EVERY", CHUNK)


def write(path, chunks: int) -> stream.RecordingFileSystem:
    fs = stream.RecordingFileSystem()
    with fs.create_stream(path, "wb") as f:
        for i in range(chunks):
            f.write(bytes([i]) * CHUNK)
    return fs


def test_each_range_is_dropped_only_after_the_disk_has_it(tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    fs = write(tmp_path / "f", 10)
    data = (tmp_path / "f").read_bytes()
    assert fs.sums[str(tmp_path / "f")] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    drops = [c for c in spy.calls if c[0] == "drop"]
    assert [(s, n) for _, s, n, _ in drops] == [(i * CHUNK, CHUNK) for i in range(9)], "every range but the last"
    assert all(advice == os.POSIX_FADV_DONTNEED for *_, advice in drops)
    for drop in drops:
        before = spy.calls[:spy.calls.index(drop)]
        waited = [c for c in before if c[1:3] == drop[1:3] and c[3] & stream._WAIT_AFTER]
        started = [c for c in before if c[1:3] == drop[1:3] and c[3] == stream._WRITE]
        assert waited and started, f"range {drop[1:3]} dropped before the disk had it: {before}"


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failed_write_back_is_raised_naming_the_file(tmp_path, monkeypatch, code):
    Spy(monkeypatch, fail=code)
    fs = stream.RecordingFileSystem()
    with pytest.raises(OSError) as raised:
        with fs.create_stream(tmp_path / "f", "wb") as f:
            for i in range(5):
                f.write(bytes([i]) * CHUNK)
    assert raised.value.errno == code and raised.value.filename == str(tmp_path / "f")
    assert fs.errors and fs.errors[0].errno == code, "recorded for the writer to raise on its rank"
    assert str(tmp_path / "f") not in fs.sums


def test_a_file_system_without_sync_file_range_only_ends_the_early_write_back(tmp_path, monkeypatch):
    spy = Spy(monkeypatch, fail=errno.EINVAL)
    fs = write(tmp_path / "f", 10)
    assert fs.errors == [] and (tmp_path / "f").stat().st_size == 10 * CHUNK
    assert len([c for c in spy.calls if c[3] & stream._WAIT_AFTER]) == 1, "not tried again for this file"
    assert not [c for c in spy.calls if c[0] == "drop"], "nothing dropped that was not written back"


def test_without_drop_behind_write_back_is_only_started(tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    fs = stream.RecordingFileSystem(drop_behind=False)
    with fs.create_stream(tmp_path / "f", "wb") as f:
        for i in range(10):
            f.write(bytes([i]) * CHUNK)
    assert (tmp_path / "f").read_bytes() == b"".join(bytes([i]) * CHUNK for i in range(10))
    assert spy.calls and all(c[0] == "sync" and c[3] == stream._WRITE for c in spy.calls), spy.calls


def drops_of_a_save(path: str, drop_behind: bool) -> int:
    """Page-cache drops of one partial save under ``checkpoint_drop_behind`` (ranges of 4 KiB)."""
    import modelparallel as smp
    from ckpt_helpers import build

    smp.init({"tensor_parallel_degree": 2, "checkpoint_drop_behind": drop_behind})
    build(init=False)
    drops, real, before = [], stream.os.posix_fadvise, stream.SYNC_EVERY
    stream.os.posix_fadvise = lambda *a: (drops.append(a), real(*a))[1]
    stream.SYNC_EVERY = 4096
    try:
        smp.save_checkpoint(path, f"d{int(drop_behind)}")
    finally:
        stream.os.posix_fadvise, stream.SYNC_EVERY = real, before
    return len(drops)


def test_the_config_key_reaches_every_ranks_writer(tmp_path):
    import harness

    assert all(n > 0 for n in harness.run(2, drops_of_a_save, str(tmp_path), True))
    assert harness.run(2, drops_of_a_save, str(tmp_path), False) == [0, 0]
