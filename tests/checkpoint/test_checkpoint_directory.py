"""A checkpoint directory is the library's and one job's: nobody else takes it, retention
deletes only what the library wrote, and a manifest too large or too deep is a named error.

A failure means another process could lock the directory between this job's saves (lock.py),
retention or leftover cleaning deleted a file the library did not write (commit.py), or a
malformed manifest broke a save or a load without naming the file (manifest.py). Multi-rank
scenarios run on 2 ranks at TP=2 (modelparallel/checkpoint/safety/).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness
import modelparallel as smp
from ckpt_helpers import build, error_of, on_rank0
from modelparallel.checkpoint.safety import commit


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
