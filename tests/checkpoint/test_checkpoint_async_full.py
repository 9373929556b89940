"""Asynchronous full checkpoints (``save_checkpoint(..., partial=False, async_save=True)``): the
values of the call are what is saved (a Hugging Face directory and SageMaker's single file), and a
failure of rank 0's background write is raised on every rank and leaves the previous newest.

A failure means modelparallel/checkpoint/background/async_full.py (rank 0's collected copy, the background
phase) or the async branches of full.py / single_file.py let training reach the checkpoint, lost
an error, or moved ``newest`` before the checkpoint was durable. 2 ranks at TP=2.
"""

import threading
from pathlib import Path

import torch

import harness
import modelparallel as smp
from ckpt_helpers import build, changed, error_of, snapshot
from faults import WRITES, inject
from modelparallel.checkpoint.safety import commit
from modelparallel.checkpoint.save import full
from modelparallel.checkpoint import single_file


def _train_and_touch(model, optimizer) -> None:
    ids = torch.arange(8).reshape(1, 8) % 64
    model.backward(model(ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        model.module.transformer.wpe.weight.add_(1.0)  # replicated: the collected copy must own its memory


def _held(fn, release: threading.Event):
    """``fn`` that first waits for ``release``: rank 0's background write starts only then."""
    def held(*args, **kwargs):
        release.wait()
        return fn(*args, **kwargs)
    return held


def values_of_the_call(path: str) -> dict:
    """Each save's background write is held until training has changed the model."""
    model, optimizer = build()
    want = {}
    real = full.ShardWriter, single_file._commit
    try:
        for tag in ("dir", "single.pt"):
            release = threading.Event()
            full.ShardWriter, single_file._commit = (_held(f, release) for f in real)
            smp.save_checkpoint(path, tag, partial=False, user_content={"tag": tag}, async_save=True)
            want[tag] = snapshot(model)
            _train_and_touch(model, optimizer)
            release.set()
        smp.wait_for_checkpoints()
    finally:
        full.ShardWriter, single_file._commit = real
    newest = commit.read_newest(path)
    out = {"newest": newest}
    for tag in ("dir", "single.pt"):
        fresh, _ = build(seed=5)
        content = smp.resume_from_checkpoint(path, tag, partial=False)
        out[tag] = (content, changed(want[tag], snapshot(fresh)))
    return out


def test_async_full_saves_hold_the_values_of_the_call(tmp_path):
    for r in harness.run(2, values_of_the_call, str(tmp_path)):
        assert r["newest"] == "single.pt", r
        assert r["dir"] == ({"tag": "dir"}, []) and r["single.pt"] == ({"tag": "single.pt"}, []), r


def background_failure(path: str) -> dict:
    """ENOSPC at rank 0's first write of the second save: both ranks raise it at the next wait;
    the first save stays newest and loads; the job saves again."""
    model, optimizer = build()
    smp.save_checkpoint(path, "a", partial=False, async_save=True)
    smp.wait_for_checkpoints()
    want = snapshot(model)
    _train_and_touch(model, optimizer)
    with inject(Path(path), 1 if smp.rank() == 0 else 0, "error", only=WRITES) as counter:
        smp.save_checkpoint(path, "b", partial=False, async_save=True)
        msg = error_of(smp.wait_for_checkpoints)
    smp.barrier()
    newest = commit.read_newest(path)
    leftovers = sorted(p.name for p in Path(path).iterdir() if p.name.startswith(".mp-"))
    fresh, _ = build(seed=5)
    smp.resume_from_checkpoint(path, partial=False)
    intact = changed(want, snapshot(fresh))
    smp.save_checkpoint(path, "c", partial=False, async_save=True)
    smp.wait_for_checkpoints()
    return {"msg": msg, "fired": counter.fired, "newest": newest, "intact": intact, "leftovers": leftovers,
            "after": commit.read_newest(path)}


def test_a_failed_background_full_write_is_raised_on_every_rank(tmp_path):
    results = harness.run(2, background_failure, str(tmp_path))
    assert results[0]["msg"] == results[1]["msg"], results
    first = results[0]["msg"].splitlines()[0]
    assert "No space left on device" in first and "full save (write)" in results[0]["msg"], results[0]["msg"]
    assert results[0]["fired"], "the fault was injected in rank 0's background write"
    for r in results:
        assert r["newest"] == "a" and r["intact"] == [] and r["after"] == "c", r
        assert r["leftovers"] in ([], [commit.LOCK]), r["leftovers"]
