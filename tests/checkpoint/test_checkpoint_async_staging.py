"""Background staging of asynchronous partial saves (``async_staging=True``, the default): the
parameters and optimizer slots are copied by the background thread, the optimizer's next step
waits for that copy, and a parameter changed in place another way before its copy fails the save.

A failure means modelparallel/checkpoint/background/async_save.py (``Stager.stage``'s deferred copies,
``Stager.copy_deferred``'s version check, ``Job.hold``) or partial.py's ``step_only`` let a
change after the call reach the checkpoint, let a step run before staging ended, or let a torn
copy be committed. Staging is paused with the stager's ``before_copy`` hook, so the order of
events is fixed, not left to timing. 2 ranks, TP=2.
"""

import threading
import time
from pathlib import Path

import pytest
import torch

import harness
import modelparallel as smp
from modelparallel import runtime
from modelparallel.checkpoint.safety import commit
from modelparallel.checkpoint.api import _saver
from modelparallel.checkpoint.background.deferred import Early
from ckpt_helpers import build, changed, error_of, snapshot
from state_helpers import recording_defers


def _step(model, optimizer) -> None:
    ids = torch.arange(8).reshape(1, 8) % 64
    model.backward(model(ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()


def step_waits_for_staging(path: str) -> dict:
    """Staging is held until the next optimizer step starts, and its copy then takes 0.2 s; the
    step must wait for it (a step pre-hook registered after the save sees staging done), and the
    checkpoint holds the values of the call."""
    model, optimizer = build()
    saver = _saver()
    release = threading.Event()
    saver.stager.before_copy = lambda: (release.wait(), time.sleep(0.2))  # a copy that takes a while
    entry, seen = [], []

    def at_entry(*_):  # registered before the save's hook, so it runs first: staging is still paused
        entry.append(saver.job.staged.is_set())
        release.set()

    first = optimizer.optimizer.register_step_pre_hook(at_entry)
    smp.save_checkpoint(path, "a", async_save=True)
    want = snapshot(model, optimizer)
    job = saver.job
    deferred = saver.stager.deferred_bytes
    late = optimizer.optimizer.register_step_pre_hook(lambda *_: seen.append(job.staged.is_set()))
    safety = threading.Timer(60, release.set)  # never needed unless the step is never reached
    safety.start()
    _step(model, optimizer)
    safety.cancel()
    first.remove()
    late.remove()
    held = job.held_s
    smp.wait_for_checkpoints()
    hooks_left = len(optimizer.optimizer._optimizer_step_pre_hooks)
    fresh, fresh_opt = build(seed=5)
    smp.resume_from_checkpoint(path)
    return {"entry": entry, "seen": seen, "held": held, "deferred": deferred,
            "diff": changed(want, snapshot(fresh, fresh_opt)),
            "hooks_left": hooks_left}


def test_the_step_after_a_save_waits_for_background_staging(tmp_path):
    for r in harness.run(2, step_waits_for_staging, str(tmp_path)):
        assert r["deferred"] > 0, "parameters and optimizer slots were left to the background"
        assert r["entry"] == [False], "staging was done before the step started: the test proves nothing"
        assert r["seen"] == [True], "the optimizer step ran before staging was done"
        assert r["held"] > 0.1, f"the step's wait was not counted: {r['held']} (the copy takes >= 0.2 s)"
        assert r["diff"] == [], r["diff"]
        assert r["hooks_left"] == 0, "the step hook is removed once the save is done"


def change_during_staging(path: str) -> dict:
    """A parameter changed in place (outside the optimizer) while staging is held: the save is
    refused on every rank, naming the parameter; the previous newest stays and loads."""
    model, optimizer = build()
    smp.save_checkpoint(path, "a", async_save=True)
    smp.wait_for_checkpoints()
    want = snapshot(model, optimizer)
    release = threading.Event()
    runtime.current().checkpoint_saver.stager.before_copy = release.wait
    smp.save_checkpoint(path, "b", async_save=True)
    with torch.no_grad():
        model.module.transformer.h[0].mlp.c_fc.weight.mul_(2.0)
    release.set()
    msg = error_of(smp.wait_for_checkpoints)
    runtime.current().checkpoint_saver.stager.before_copy = None
    smp.barrier()  # rank 0 removes the abandoned staging directory before its wait returns
    newest = commit.read_newest(path)
    leftovers = sorted(p.name for p in Path(path).iterdir() if p.name.startswith(".mp-staging"))
    fresh, fresh_opt = build(seed=5)
    smp.resume_from_checkpoint(path)
    return {"msg": msg, "newest": newest, "leftovers": leftovers, "intact": changed(want, snapshot(fresh, fresh_opt))}


def test_an_in_place_change_before_staging_fails_that_save_on_every_rank(tmp_path):
    results = harness.run(2, change_during_staging, str(tmp_path))
    assert results[0]["msg"] == results[1]["msg"], results
    msg = results[0]["msg"]
    assert "model.transformer.h.0.mlp.c_fc.weight" in msg and "changed in place" in msg, msg
    assert "async_staging=False" in msg and "previous newest checkpoint is intact" in msg, msg
    for r in results:
        assert r["newest"] == "a_partial" and r["intact"] == [] and r["leftovers"] == [], r


def synchronous_staging(path: str) -> dict:
    """``async_staging=False``: everything is copied in the call, no step waits, and an in-place
    change right after the call is harmless."""
    model, optimizer = build()
    saver = _saver()
    saver.stager.before_copy = lambda: time.sleep(60)  # would stall a background copy
    smp.save_checkpoint(path, "a", async_save=True, async_staging=False)
    want = snapshot(model, optimizer)
    hooks = len(saver.job.hooks)
    deferred = saver.stager.deferred_bytes
    with torch.no_grad():
        model.module.transformer.h[0].mlp.c_fc.weight.mul_(2.0)
    _step(model, optimizer)
    smp.wait_for_checkpoints()
    fresh, fresh_opt = build(seed=5)
    smp.resume_from_checkpoint(path)
    return {"hooks": hooks, "deferred": deferred, "diff": changed(want, snapshot(fresh, fresh_opt))}


def test_synchronous_staging_copies_everything_in_the_call(tmp_path):
    for r in harness.run(2, synchronous_staging, str(tmp_path)):
        assert r == {"hooks": 0, "deferred": 0, "diff": []}, r


def load_waits_for_staging(path: str) -> dict:
    """``DistributedModel.load_state_dict`` / ``DistributedOptimizer.load_state_dict`` right after
    a save wait for its background copy (released 0.3 s later): the save succeeds with the
    values of the call, and the loads then take effect."""
    model, optimizer = build()
    other_model, other_opt = build(seed=3, init=False)
    new_model, new_opt = other_model.state_dict(), other_opt.state_dict()
    release = threading.Event()
    _saver().stager.before_copy = release.wait
    smp.save_checkpoint(path, "a", model=model, optimizer=optimizer, async_save=True)
    want = snapshot(model, optimizer)
    threading.Timer(0.3, release.set).start()
    model.load_state_dict(new_model)
    optimizer.load_state_dict(new_opt)
    loaded = changed(snapshot(other_model, other_opt), snapshot(model, optimizer))
    smp.wait_for_checkpoints()
    fresh, fresh_opt = build(seed=5)
    smp.resume_from_checkpoint(path)
    return {"saved": changed(want, snapshot(fresh, fresh_opt)), "loaded": loaded}


def test_our_loads_wait_for_background_staging(tmp_path):
    for r in harness.run(2, load_waits_for_staging, str(tmp_path)):
        assert r == {"saved": [], "loaded": []}, r


def _edits(model, optimizer) -> dict:
    """In-place changes that bypass a tensor's version counter: through ``.data`` and numpy."""
    w = model.module.transformer.h[0].mlp.c_fc.weight
    local = w.to_local() if hasattr(w, "to_local") else w
    slot = optimizer.optimizer.state[w]["exp_avg"]
    slot_local = slot.to_local() if hasattr(slot, "to_local") else slot
    return {"data.clamp_": lambda: local.data.clamp_(-1e-4, 1e-4),
            "data.mul_": lambda: local.data.mul_(2.0),
            "exp_avg.data.zero_": lambda: slot_local.data.zero_(),
            "numpy view": lambda: local.detach().numpy().__imul__(3.0)}


def edits_that_bypass_version_counters(path: str, way: str) -> dict:
    """Each edit, made while staging is held: the save is refused on every rank and the previous
    newest still holds the values of its own call. ``way``: ``"pages"``, the deferred tensors'
    pages write-protected by the call (the kernel's write tracking, ``background/pages.py``; its
    size floor lowered to this model's shards); ``"early"``, their CRC32s read by threads while the
    call does the rest (``Early``, used where a rank has a core to spare; forced here); ``"read"``,
    read by the call as it stages."""
    pays, take, taken = Early.pays, Early.take, []
    Early.pays = classmethod(lambda cls: way == "early")
    Early.take = lambda self, t: taken.append(1) or take(self, t)
    try:
        return {**_edits_that_bypass_version_counters(path, way), "taken": len(taken)}
    finally:
        Early.pays, Early.take = pays, take


def _edits_that_bypass_version_counters(path: str, way: str) -> dict:
    model, optimizer = build(n_embd=64)  # c_fc's shard: 32 kB, eight pages
    stager = _saver().stager
    watched: set = set()
    stager.defer = recording_defers(stager, watched)
    if way == "pages":
        stager.pages.min_bytes = stager.pages.min_save_bytes = 0
    else:
        stager.pages = None
    smp.save_checkpoint(path, "a", async_save=True)
    smp.wait_for_checkpoints()
    want = snapshot(model, optimizer)
    out = {}
    for i, (what, edit) in enumerate(_edits(model, optimizer).items()):
        release = threading.Event()
        stager.before_copy = release.wait
        smp.save_checkpoint(path, f"b{i}", async_save=True)
        edit()
        release.set()
        out[what] = error_of(smp.wait_for_checkpoints)
    stager.before_copy = None
    smp.barrier()
    out["newest"] = commit.read_newest(path)
    fresh, fresh_opt = build(seed=5, n_embd=64)
    smp.resume_from_checkpoint(path)
    out["intact"] = changed(want, snapshot(fresh, fresh_opt))
    out["watched"] = sorted(watched)
    return out


@pytest.mark.parametrize("way", ["read", "early", "pages"])
def test_changes_through_data_and_numpy_fail_the_save(tmp_path, way):
    results = harness.run(2, edits_that_bypass_version_counters, str(tmp_path), way)
    for r in results:
        assert (r["taken"] > 0) == (way == "early"), r["taken"]
        assert r["newest"] == "a_partial" and r["intact"] == [], r
        for what in ("data.clamp_", "data.mul_", "numpy view"):
            assert "model.transformer.h.0.mlp.c_fc.weight" in r[what] and "changed in place" in r[what], (what, r)
        assert "changed in place" in r["exp_avg.data.zero_"] and "exp_avg" in r["exp_avg.data.zero_"], r
        edited = {"model.transformer.h.0.mlp.c_fc.weight", "optimizer.optimizer.state.transformer.h.0.mlp.c_fc.weight.exp_avg"}
        assert (edited <= set(r["watched"])) if way == "pages" else r["watched"] == [], r["watched"]


def test_the_stager_compares_bytes_for_every_dtype_and_copies_views_at_once():
    """One process: a bf16 tensor changed through ``.data`` after ``defer`` is named; a
    non-contiguous view is copied in the call (its later change does not reach the buffer)."""
    from modelparallel.checkpoint.background.stager import Stager, StagedTensorChanged

    stager = Stager()
    half = torch.arange(64, dtype=torch.bfloat16)
    buf = stager.buffer(("half",), half)
    stager.defer("half", half, half, buf)
    half.data.add_(1)
    try:
        stager.copy_deferred()
        raise AssertionError("a bf16 change through .data was not caught")
    except StagedTensorChanged as e:
        assert "half" in str(e), e
    base = torch.arange(12.0).reshape(3, 4)
    view = base.t()
    want = view.clone()
    vbuf = stager.buffer(("view",), view)
    deferred = stager.deferred_bytes
    stager.defer("view", view, view, vbuf)
    base.data.mul_(2)
    stager.copy_deferred()
    assert torch.equal(vbuf, want) and stager.deferred_bytes == deferred, "the view was not copied in the call"
