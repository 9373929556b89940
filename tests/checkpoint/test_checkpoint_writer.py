"""The save's writer (modelparallel/checkpoint/save/writer.py): checksums computed while writing,
write-back started early, torch.save's zip CRC off only while it writes.

A failure means a manifest could record a CRC32 that is not the file's (every later load of a
good checkpoint would be refused as corrupted, or worse, a file changed after a seek would be
recorded by a checksum of bytes it no longer holds), that a save leaves the process's
torch.save setting changed, or that a partial checkpoint is no longer a plain DCP checkpoint
that DCP's own reader loads.
"""

import threading
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from modelparallel.checkpoint.save import stream, writer
from modelparallel.checkpoint.save.planner import ContiguousSavePlanner


def real_sum(path) -> dict:
    data = path.read_bytes()
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(300, 70, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "t": torch.randn(8, 6, generator=g).t(), "step": 7, "name": "x"}


@pytest.mark.parametrize("sync_every", [stream.SYNC_EVERY, 1000])
def test_checksums_while_writing_equal_the_files(tmp_path, monkeypatch, sync_every):
    """Every file the save wrote (data and metadata) is in ``sums`` with its real size and
    CRC32, also when write-back is started many times (a small ``SYNC_EVERY``)."""
    monkeypatch.setattr(stream, "SYNC_EVERY", sync_every)
    sums = writer.save(state(), tmp_path, ContiguousSavePlanner())
    files = sorted(p for p in tmp_path.iterdir() if p.is_file())
    assert sorted(sums) == [str(p) for p in files] and len(files) >= 2, (sums, files)
    for p in files:
        assert sums[str(p)] == real_sum(p), p.name


def test_a_stream_that_seeks_records_no_checksum(tmp_path):
    fs = stream.RecordingFileSystem()
    with fs.create_stream(tmp_path / "seeked", "wb") as f:
        f.write(b"abcdef")
        f.seek(1)
        f.write(b"X")
    with fs.create_stream(tmp_path / "straight", "wb") as f:
        f.write(b"abc")
        f.write(memoryview(b"def"))
    assert sorted(fs.sums) == [str(tmp_path / "straight")]
    assert fs.sums[str(tmp_path / "straight")] == real_sum(tmp_path / "straight")


def test_a_failed_write_records_no_checksum(tmp_path):
    fs = stream.RecordingFileSystem()
    with pytest.raises(RuntimeError):
        with fs.create_stream(tmp_path / "f", "wb") as f:
            f.write(b"abc")
            raise RuntimeError("stop")
    assert fs.sums == {}


def _setting_seen_by_main_after_a_thread_switches_it_off() -> bool:
    """The main thread's CRC setting after another thread switched its own off: True where PyTorch
    keeps the setting per thread (torch 2.13), False where it is process-wide (torch 2.11)."""
    torch.serialization.set_crc32_options(True)
    thread = threading.Thread(target=torch.serialization.set_crc32_options, args=(False,))
    thread.start()
    thread.join()
    seen = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    return seen


def test_a_background_write_leaves_the_zip_crc_setting_alone(tmp_path, monkeypatch):
    """Training's own torch.save calls run while a background save writes: they keep the CRC,
    while the background write runs without it where PyTorch keeps the setting per thread (with
    a process-wide setting the background write keeps the CRC instead)."""
    per_thread = _setting_seen_by_main_after_a_thread_switches_it_off()
    seen, writing, checked = [], threading.Event(), threading.Event()
    real = writer.dcp.save

    def save(*a, **k):
        seen.append(torch.serialization.get_crc32_options())
        if threading.current_thread() is not threading.main_thread():
            writing.set()
            assert checked.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(writer.dcp, "save", save)
    assert torch.serialization.get_crc32_options() is True
    thread = threading.Thread(target=writer.save, args=(state(), tmp_path / "bg", ContiguousSavePlanner()))
    thread.start()
    assert writing.wait(30)
    during = torch.serialization.get_crc32_options()
    checked.set()
    thread.join()
    assert during is True, "the main thread's setting while a background save writes"
    writer.save(state(), tmp_path / "fg", ContiguousSavePlanner())
    assert seen == [not per_thread, False], \
        "off for the background save's thread (if per thread) and for the main thread's save"
    assert torch.serialization.get_crc32_options() is True


def test_the_crc_setting_probe_tells_per_thread_from_process_wide(monkeypatch):
    """Where PyTorch kept the setting process-wide, a background save would switch it off for
    training too: the probe must say so (a process-wide setting is simulated)."""
    assert writer._crc_setting_is_per_thread() is _setting_seen_by_main_after_a_thread_switches_it_off()
    shared = {"on": True}
    monkeypatch.setattr(torch.serialization, "get_crc32_options", lambda: shared["on"])
    monkeypatch.setattr(torch.serialization, "set_crc32_options", lambda on: shared.update(on=on))
    assert writer._crc_setting_is_per_thread() is False and shared["on"] is True
    seen = []
    thread = threading.Thread(target=lambda: seen.append(writer._no_zip_crc().__enter__() or shared["on"]))
    thread.start()
    thread.join()
    assert seen == [True], "a background thread leaves a process-wide setting on"


@pytest.mark.parametrize("before", [True, False])
def test_zip_crc_setting_is_put_back_and_dcp_loads_the_files(tmp_path, before):
    original = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(before)
    try:
        writer.save(state(), tmp_path / "ok", ContiguousSavePlanner())
        assert torch.serialization.get_crc32_options() is before
        (tmp_path / "a-file").write_bytes(b"")
        with pytest.raises((CheckpointException, OSError)):
            writer.save({"a": torch.ones(2)}, tmp_path / "a-file", ContiguousSavePlanner())
        assert torch.serialization.get_crc32_options() is before, "put back after a failed save too"
    finally:
        torch.serialization.set_crc32_options(original)
    want = state()
    target = {"a": torch.zeros(300, 70), "b": torch.zeros(5, dtype=torch.bfloat16), "t": torch.zeros(6, 8),
              "step": 0, "name": ""}
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "ok"))
    for k, v in want.items():
        assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v, k
