"""Asynchronous partial saves (``save_checkpoint(..., async_save=True)``): the values of the call
are what is saved, one save is in flight at a time, staging buffers are reused, a background
failure is raised on every rank and loses nothing, an exit without waiting still commits, and
the jobs of one process share one background process group.

A failure means the background writer (modelparallel/checkpoint/background/async_save.py) or the split of
a save into staging and background phases (partial.py ``save`` / ``_Phases``) broke a guarantee
of synchronous saves. Multi-rank scenarios run on 2 ranks at TP=2.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import harness
import modelparallel as smp
from modelparallel import runtime
from ckpt_helpers import build, changed, error_of, snapshot
from faults import WRITES, inject
from modelparallel.checkpoint.safety import commit


def _step(model, optimizer) -> None:
    ids = torch.arange(8).reshape(1, 8) % 64
    model.backward(model(ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()


def values_of_the_call(path: str, sync_every: int | None = None) -> dict:
    from modelparallel.checkpoint.save import stream

    before = stream.SYNC_EVERY
    if sync_every is not None:  # ranges this small: the background writer drops behind many times
        stream.SYNC_EVERY = sync_every
    try:
        return _values_of_the_call(path)
    finally:
        stream.SYNC_EVERY = before


def _values_of_the_call(path: str) -> dict:
    model, optimizer = build()
    want = []
    staged = []
    for tag in ("a", "b", "c"):
        smp.save_checkpoint(path, tag, user_content={"tag": tag}, async_save=True, num_kept_partial_checkpoints=2)
        want.append(snapshot(model, optimizer))
        buffers = runtime.current().checkpoint_saver.stager.buffers.values()
        staged.append((smp.checkpoint_staging_bytes(), sorted(b.data_ptr() for b in buffers)))
        _step(model, optimizer)  # training goes on while the save is written: must not leak into it
        with torch.no_grad():
            model.module.transformer.wpe.weight.add_(1.0)
    smp.wait_for_checkpoints()
    listing = sorted(os.listdir(path))
    fresh, fresh_opt = build(seed=5)
    content = smp.resume_from_checkpoint(path)
    got_c = snapshot(fresh, fresh_opt)
    smp.resume_from_checkpoint(path, "b")
    return {"listing": listing, "content": content, "c": changed(want[2], got_c),
            "b": changed(want[1], snapshot(fresh, fresh_opt)), "staged": staged}


@pytest.mark.parametrize("sync_every", [None, 4096], ids=["default", "drop-behind-every-4kib"])
def test_async_saves_hold_the_values_of_the_call_and_reuse_their_buffers(tmp_path, sync_every):
    for r in harness.run(2, values_of_the_call, str(tmp_path), sync_every):
        assert r["listing"] == [commit.LOCK, "b_partial", "c_partial", "newest"], r["listing"]
        assert r["content"] == {"tag": "c"} and r["c"] == [] and r["b"] == [], r
        sizes, pointers = zip(*r["staged"])
        assert sizes[0] > 0 and len(set(sizes)) == 1, sizes
        assert pointers[0] == pointers[1] == pointers[2], "staging buffers are reused between saves"


def jobs_with_async_saves(path: str, jobs: int) -> list[int]:
    """This rank's thread count after each of ``jobs`` jobs (``smp.init``, a model, an
    asynchronous save and its wait)."""
    counts = []
    for job in range(jobs):
        build()
        smp.save_checkpoint(path, f"job{job}", async_save=True, num_kept_partial_checkpoints=1)
        smp.wait_for_checkpoints()
        counts.append(harness.thread_count())
    return counts


def test_later_jobs_reuse_the_background_process_group(tmp_path):
    """The background writer's gloo group (three threads and their sockets, kept until the
    process ends) is made once per process and world: a script or test process that runs job
    after job, each saving asynchronously, does not gain threads after the first job."""
    for rank, counts in enumerate(harness.run(2, jobs_with_async_saves, str(tmp_path), 4)):
        assert counts[1:] == counts[:1] * 3, f"rank {rank}: threads after each job {counts}"


def background_failure(path: str) -> dict:
    """ENOSPC at the first write of rank 1's background save: every rank raises it at the next wait,
    naming the file; the previous newest still loads bit for bit, and the job saves again."""
    model, optimizer = build()
    smp.save_checkpoint(path, "a", async_save=True)
    smp.wait_for_checkpoints()
    want = snapshot(model, optimizer)
    _step(model, optimizer)
    with inject(Path(path), 1 if smp.rank() == 1 else 0, "error", only=WRITES) as counter:
        smp.save_checkpoint(path, "b", async_save=True)
        msg = error_of(smp.wait_for_checkpoints)
    fired = counter.fired
    newest = commit.read_newest(path)
    fresh, fresh_opt = build(seed=5)
    smp.resume_from_checkpoint(path)
    intact = changed(want, snapshot(fresh, fresh_opt))
    smp.save_checkpoint(path, "c", async_save=True)  # the job goes on saving
    smp.wait_for_checkpoints()
    return {"msg": msg, "fired": fired, "newest": newest, "intact": intact, "after": commit.read_newest(path)}


def test_a_background_failure_is_raised_on_every_rank_and_loses_nothing(tmp_path):
    results = harness.run(2, background_failure, str(tmp_path))
    assert results[0]["msg"] == results[1]["msg"]
    first = results[0]["msg"].splitlines()[0]
    assert "No space left on device" in first and ".mp-staging-" in first and "b_partial" in first, first
    assert results[1]["fired"], "the fault was injected in rank 1's background save"
    for r in results:
        assert r["newest"] == "a_partial" and r["intact"] == [] and r["after"] == "c_partial", r


EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import modelparallel as smp
    from transformers import GPT2Config, GPT2LMHeadModel
    from modelparallel.checkpoint.save import partial
    smp.init({"tensor_parallel_degree": 1})
    model = smp.DistributedModel(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64,
                                                            n_positions=8)))
    smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
    if sys.argv[2] == "fail":
        def fail(*a, **k):
            raise OSError(5, "Input/output error (simulated)")
        partial._write = fail
    smp.save_checkpoint(sys.argv[1], "last", async_save=True)
    print("returned", flush=True)
""")


def test_an_exit_without_waiting_commits_or_says_what_was_lost(tmp_path):
    """Both jobs at once (each a process of its own, with its own port): their start-up is most
    of their time."""
    def start(name: str, port: int) -> subprocess.Popen:
        env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        return subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / name), name],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    jobs = [start("ok", 29700 + os.getpid() % 200), start("fail", 29900 + os.getpid() % 200)]
    (ok_out, ok_err), (_, failed_err) = (job.communicate(timeout=600) for job in jobs)
    assert jobs[0].returncode == 0 and "returned" in ok_out, ok_err[-2000:]
    assert commit.read_newest(tmp_path / "ok") == "last_partial", "the save in flight was committed at exit"
    assert "asynchronous checkpoint 'last' was not committed: " in failed_err, failed_err[-2000:]
    assert "Input/output error (simulated)" in failed_err
    assert commit.read_newest(tmp_path / "fail") is None
