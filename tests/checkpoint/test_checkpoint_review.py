"""The smaller findings of an adversarial review of the checkpoint layer, one test each.

Each scenario states the finding it guards; a failure means that hole is open again: an
optimizer or model of another kind loaded silently, a second job could delete this job's
checkpoints, retention deleted what the library did not write, a malformed or huge manifest
broke a save or a load without naming the file, a disk-full error lost its cause or left
temporary files, a dtype lie cast silently, or a user dict came back as another type.
Multi-rank scenarios run on 2 ranks at TP=2 (modelparallel/checkpoint/*).
"""

import collections
import errno
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import harness
import modelparallel as smp
from ckpt_helpers import build, changed, error_of, on_rank0, refresh_manifest, snapshot
from modelparallel.checkpoint.safety import commit


def other_kinds(path: str) -> dict:
    """AdamW state into SGD; a checkpoint of 2 heads into a model of 4 heads of the same sizes."""
    build()
    smp.save_checkpoint(path, "a")
    model, optimizer = build(seed=1, optimizer_cls=torch.optim.SGD)
    before = snapshot(model, optimizer)
    msgs = {"sgd": error_of(smp.resume_from_checkpoint, path)}
    sgd_changed = changed(before, snapshot(model, optimizer))
    model, optimizer = build(seed=1, n_head=4)
    msgs["heads"] = error_of(smp.resume_from_checkpoint, path)
    smp.resume_from_checkpoint(path, strict=False)  # non-strict: loads what fits, reports the rest
    return {"msgs": msgs, "changed": sgd_changed, "report": smp.last_load_report()["model"]}


def test_optimizer_class_and_model_config_are_compared(tmp_path):
    for r in harness.run(2, other_kinds, str(tmp_path)):
        assert "optimizer: the checkpoint holds AdamW state, this optimizer is SGD" in r["msgs"]["sgd"], r["msgs"]
        assert "config n_head: checkpoint 2, model 4" in r["msgs"]["heads"], r["msgs"]["heads"]
        assert "config n_head: checkpoint 2, model 4" in r["report"].mismatched_shapes
        assert r["changed"] == []


def job_lock(path: str, asynchronous: bool = False) -> dict:
    """Between two saves of this job, another process cannot take the directory's lock (also
    while an asynchronous save is still being written)."""
    build()
    smp.save_checkpoint(path, "a", async_save=asynchronous)
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(7)\n")
    locked = None
    if smp.rank() == 0:
        locked = subprocess.run([sys.executable, "-c", probe, str(Path(path) / commit.LOCK)]).returncode == 7
    smp.save_checkpoint(path, "b", num_kept_partial_checkpoints=1, async_save=asynchronous)  # the job saves again
    smp.wait_for_checkpoints()
    return {"locked": locked, "listing": sorted(os.listdir(path))}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_directory_stays_locked_for_the_job_between_saves(tmp_path, asynchronous):
    r = harness.run(2, job_lock, str(tmp_path), asynchronous)[0]
    assert r["locked"], "another process could lock the directory between this job's saves"
    assert r["listing"] == [commit.LOCK, "b_partial", "newest"]


def foreign_entries(path: str) -> dict:
    """Retention and leftover cleaning touch only what the library wrote; a manifest nested
    100000 deep is a named error, and does not make a save with retention fail after its commit."""
    root = Path(path)
    build()
    smp.save_checkpoint(root, "a")

    def plant():
        (root / ".mp-notes").write_text("mine")
        (root / ".mp-staging-mine").mkdir()
        (root / "deep_partial").mkdir()
        (root / "deep_partial" / commit.MANIFEST).write_text("[" * 100000 + "]" * 100000)

    on_rank0(plant)
    msg = error_of(smp.resume_from_checkpoint, root, "deep")
    smp.save_checkpoint(root, "b", num_kept_partial_checkpoints=1)
    return {"msg": msg, "listing": sorted(os.listdir(root))}


def test_retention_deletes_only_what_the_library_wrote(tmp_path):
    for r in harness.run(2, foreign_entries, str(tmp_path)):
        assert f"deep_partial/{commit.MANIFEST}" in r["msg"] and "nested too deeply" in r["msg"], r["msg"]
        assert r["listing"] == [".mp-lock", ".mp-notes", ".mp-staging-mine", "b_partial", "deep_partial", "newest"]


def test_an_oversized_manifest_is_refused_before_it_is_read(tmp_path):
    from modelparallel.checkpoint.safety import manifest

    (tmp_path / "big_partial").mkdir()
    with open(tmp_path / "big_partial" / commit.MANIFEST, "wb") as f:
        f.truncate(manifest.MAX_MANIFEST_BYTES + 1)  # sparse: no disk used
    try:
        commit.read_manifest(tmp_path / "big_partial")
    except commit.ManifestError as e:
        assert f"{manifest.MAX_MANIFEST_BYTES + 1} bytes" in str(e) and commit.MANIFEST in str(e), str(e)
    else:
        raise AssertionError("a manifest larger than the limit was read")


def _enospc_on_write(n: int):
    """Make the ``n``-th write of a file object opened for writing fail with ENOSPC."""
    import io

    real_open, count = io.open, [0]

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            count[0] += 1
            if count[0] >= n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode or "a" in mode else f

    return real_open, fake_open


def disk_full(path: str) -> dict:
    """ENOSPC at the second write of rank 1's DCP file and of rank 0's full-checkpoint shard, and
    at the write of a legacy ``smp.save``: the cause and the file are named; no temporary file stays behind."""
    import builtins
    import io

    root = Path(path)
    build()
    msgs = {}
    for what, call in (("partial", lambda: smp.save_checkpoint(root / "p", "a")),
                       ("full", lambda: smp.save_checkpoint(root / "f", "a", partial=False)),
                       ("legacy", lambda: smp.save({"w": torch.ones(1000)}, str(root / "legacy" / "x.pt"),
                                                   partial=False))):
        real, fake = _enospc_on_write(1 if what == "legacy" else 2)
        victim = {"partial": 1, "full": 0, "legacy": 0}[what]
        if smp.rank() == victim:
            io.open = builtins.open = fake
        try:
            msgs[what] = error_of(call) if what != "legacy" or smp.rank() == 0 else None
        finally:
            io.open = builtins.open = real
        smp.barrier()
    leftovers = sorted(str(p.relative_to(root)) for p in root.rglob(".mp-tmp-*"))
    return {"msgs": msgs, "leftovers": leftovers}


def test_disk_full_errors_name_the_cause_and_the_file(tmp_path):
    results = harness.run(2, disk_full, str(tmp_path))
    for r in results:
        first = r["msgs"]["partial"].splitlines()[0]
        assert "No space left on device" in first and "p/.mp-staging-" in first and "__1_0.distcp" in first, first
        first = r["msgs"]["full"].splitlines()[0]
        assert "No space left on device" in first and "model.safetensors" in first, first
    legacy = results[0]["msgs"]["legacy"]
    assert "No space left on device" in legacy and "x.pt" in legacy, legacy
    assert results[0]["leftovers"] == [], results[0]["leftovers"]


def dtype_lie(path: str) -> str:
    """A full checkpoint whose header says I32 for an F32 tensor (same byte size)."""
    root = Path(path)
    build()
    smp.save_checkpoint(root, "f", partial=False)

    def lie():
        f = root / "f" / "model.safetensors"
        data = f.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        header["transformer.h.0.mlp.c_fc.weight"]["dtype"] = "I32"
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (n - len(raw))
        f.write_bytes(data[:8] + raw + data[8 + n:])
        refresh_manifest(root / "f")

    on_rank0(lie)
    build(seed=1)
    return error_of(smp.resume_from_checkpoint, root, "f", partial=False)


def test_a_dtype_lie_in_a_full_checkpoint_is_refused(tmp_path):
    for msg in harness.run(2, dtype_lie, str(tmp_path)):
        assert "transformer.h.0.mlp.c_fc.weight" in msg and "I32" in msg and "model.safetensors" in msg, msg


def marker_shaped(path: str):
    build()
    content = {"__modelparallel_defaultdict__": "int", "items": {"a": 1}}
    smp.save_checkpoint(path, "a", user_content={"x": content, "d": collections.defaultdict(int, {"b": 2})})
    smp.save({"x": content}, os.path.join(path, "legacy.pt"), partial=False)
    smp.barrier()
    return smp.resume_from_checkpoint(path), smp.load(os.path.join(path, "legacy.pt"), partial=False)


def test_a_user_dict_shaped_like_the_defaultdict_marker_comes_back_as_it_was(tmp_path):
    content, legacy = harness.run(2, marker_shaped, str(tmp_path))[0]
    want = {"__modelparallel_defaultdict__": "int", "items": {"a": 1}}
    assert type(content["x"]) is dict and content["x"] == want, content
    assert type(content["d"]) is collections.defaultdict and content["d"] == {"b": 2}
    assert type(legacy["x"]) is dict and legacy["x"] == want, legacy
