"""Journal-mode resumes (checkpoint/load/journal.py) in bounded memory, chosen automatically, and
their failures that cannot be undone.

Through the journal, a resume into a trained model and optimizer must hold about one bucket
beyond them (a staged copy holds both once more); ``auto`` must pick the journal when
MemAvailable is small; a journal that cannot be read back must be reported naming it, never as
an intact model; a deferred resume refused at the optimizer must put a journal-loaded model back.
A failure points at journal.py (``Policy``, ``Journal.abort``), staging.py (``ModelLoad`` in
journal mode), partial_load.py (the optimizer's live slots) or pending.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

import harness
import modelparallel as smp
from ckpt_helpers import build, cfg, changed, error_of, snapshot
from modelparallel import runtime
from modelparallel.checkpoint.load import journal
from test_checkpoint_journal import BUCKET, _journals


def _hwm_reset() -> int:
    """Give the allocator's free memory back (``malloc_trim``: otherwise a new allocation may reuse
    pages already resident and not show), then reset this process's peak RSS to its current RSS
    (``/proc/self/clear_refs``); returns it in bytes."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


MIB = 1 << 20
BIG = dict(n_embd=256, n_layer=4, n_head=4, vocab=2048, n_positions=64)  # 3.7 M parameters: 44 MB with AdamW


def peak_memory(path: str) -> dict:
    """Peak RSS above the RSS before the resume, staged in memory and through a 1 MiB journal
    bucket, into a trained model and optimizer (so a staged copy duplicates both).

    glibc's default mmap threshold adapts upwards after a large block is freed, after which freed
    buckets stay in the heap for reuse and RSS shows several buckets the load no longer holds
    (6-10 MiB with 1 MiB buckets): the threshold is fixed at 64 KiB in this rank (``mallopt``)
    so that a freed bucket goes back to the system and RSS shows what the load holds."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    build(tp=1, **BIG)
    smp.save_checkpoint(path, "a")
    out = {}
    for mode in ("memory", "journal"):
        model, optimizer = build(seed=1, tp=1, **BIG)
        before = _hwm_reset()
        smp.resume_from_checkpoint(path, "a", staging=mode, staging_bucket=MIB)
        out[mode] = _status("VmHWM") - before
        out[f"{mode} cost"] = dict(runtime.current().resume.costs)
        largest = max(t.numel() * t.element_size() for t in model.module.state_dict().values())
        del model, optimizer
    out["largest"] = largest
    return out


def test_journal_mode_holds_about_one_bucket_beyond_the_model(tmp_path):
    """Staged in memory, a resume into a trained model and AdamW holds a second copy of both
    (44 MB here); through the journal it holds at most one bucket (1 MiB) plus one piece (the
    2 MB embedding), by its own accounting and by the process's peak RSS. The RSS bound allows
    10% of the staged size for what both modes allocate alike (plans, metadata, allocator)."""
    r = harness.run(1, peak_memory, str(tmp_path))[0]
    staged = sum(c.in_memory for c in r["memory cost"].values())
    bound = MIB + r["largest"]
    assert staged > 40 * MIB, r["memory cost"]
    assert all(c.in_memory <= bound for c in r["journal cost"].values()), r["journal cost"]
    assert r["memory"] >= 0.9 * staged, f"staging in memory peaked at only {r['memory'] / MIB:.1f} MiB: " \
        "the measurement does not see the staged copy"
    assert r["journal"] <= bound + 0.1 * staged, f"journal mode peaked at {r['journal'] / MIB:.1f} MiB " \
        f"above the model (staged in memory: {r['memory'] / MIB:.1f} MiB)"


def auto_choice(path: str, available: list) -> list[dict]:
    """Resume with the default ``staging`` ("auto") while ``MemAvailable`` reads each value of
    ``available`` (bytes; "3x": the staged model part's size times 3, i.e. enough for one
    rank's copy with the half margin, not for two ranks'; "unknown": the system does not say)."""
    build()
    smp.save_checkpoint(path, "a")
    model, optimizer = build(seed=1)
    smp.resume_from_checkpoint(path, "a", staging="memory")
    need = runtime.current().resume.costs["model"].in_memory
    real, out = journal.mem_available, []
    try:
        for value in available:
            journal.mem_available = lambda value=value: 3 * need if value == "3x" else \
                None if value == "unknown" else value
            smp.resume_from_checkpoint(path, "a")
            out.append({k: c.mode for k, c in runtime.current().resume.costs.items()})
    finally:
        journal.mem_available = real
    return out


def test_auto_picks_the_journal_when_memory_available_is_small(tmp_path):
    """MemAvailable 1 TB: staged in memory; 4 KiB: the journal; three times one rank's staged
    model part with two ranks on the node (each needs its copy; auto keeps half for the rest):
    the journal; unknown (no /proc/meminfo): in memory, as before."""
    for r in harness.run(2, auto_choice, str(tmp_path), [1 << 40, 4 << 10, "3x", "unknown"]):
        assert r[0] == {"model": "memory", "optimizer": "memory"}, r
        assert r[1] == {"model": "journal", "optimizer": "journal"}, r
        assert r[2]["model"] == "journal", r
        assert r[3] == {"model": "memory", "optimizer": "memory"}, r


def unreadable_journal(path: str, journal_dir: str) -> dict:
    """A resume through the journal fails (a data file flipped: its CRC fails once buckets were
    applied) and reading the journal back fails too."""
    from faults import inject

    build(tp=1)
    smp.save_checkpoint(path, "a")
    data = Path(path) / "a_partial" / "model" / "__0_0.distcp"
    flipped = bytearray(data.read_bytes())
    flipped[-2000] ^= 0x10
    data.write_bytes(bytes(flipped))
    model, optimizer = build(seed=1, tp=1)
    before = snapshot(model, optimizer)
    tempfile.tempdir = journal_dir
    try:
        with inject(journal_dir, 1, only={"preadv"}) as counter:
            msg = error_of(smp.resume_from_checkpoint, path, "a", staging="journal", staging_bucket=BUCKET)
    finally:
        tempfile.tempdir = None
    return {"msg": msg, "fired": counter.fired, "changed": changed(before, snapshot(model, optimizer)),
            "left": _journals(journal_dir)}


def test_a_journal_that_cannot_be_read_back_is_reported_loudly(tmp_path):
    (tmp_path / "j").mkdir()
    r = harness.run(1, unreadable_journal, str(tmp_path / "ck"), str(tmp_path / "j"))[0]
    first = r["msg"].splitlines()[0]
    assert r["fired"] and "mp-journal-" in r["fired"], r["fired"]
    assert first.startswith("JournalError: ") and str(tmp_path / "j" / "mp-journal-") in first, first
    assert "NOT as it was" in first and "__0_0.distcp" in r["msg"], r["msg"]
    assert r["changed"], "the test expected a model left changed (the journal could not restore it)"
    assert r["left"] == [], f"journal left behind: {r['left']}"


def deferred_then_refused(path: str) -> dict:
    """Resume before the model exists, through the journal; the model loads when created; the
    optimizer part is refused (another number of parameter groups): the model must be back."""
    build()
    smp.save_checkpoint(path, "a")
    smp.init({"tensor_parallel_degree": 2, "random_seed": 5})
    built = snapshot(smp.DistributedModel(GPT2LMHeadModel(cfg())))
    smp.init({"tensor_parallel_degree": 2, "random_seed": 5})
    smp.resume_from_checkpoint(path, staging="journal", staging_bucket=BUCKET)
    model = smp.DistributedModel(GPT2LMHeadModel(cfg()))
    loaded = changed(built, snapshot(model))
    params = list(model.parameters())
    msg = error_of(smp.DistributedOptimizer, torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}]))
    return {"loaded": loaded, "msg": msg, "changed": changed(built, snapshot(model))}


def test_deferred_journal_resume_puts_the_model_back_when_the_optimizer_is_refused(tmp_path):
    for r in harness.run(2, deferred_then_refused, str(tmp_path)):
        assert r["loaded"], "the deferred resume loaded the model when it was created"
        assert "param_groups: checkpoint has 1, this optimizer 2" in r["msg"], r["msg"]
        assert r["changed"] == [], f"the model kept the refused checkpoint's values: {r['changed'][:5]}"


def from_config(path: str, journal_dir: str) -> dict:
    """The v1-style config keys choose the mode and bucket; a bad keyword is refused before
    anything runs; a resume waiting for its optimizer and replaced by another drops its journal."""
    build()
    smp.save_checkpoint(path, "a")
    smp.init({"tensor_parallel_degree": 2, "checkpoint_staging": "journal", "checkpoint_staging_bucket": 4096})
    model, optimizer = build(seed=1, init=False)
    tempfile.tempdir = journal_dir
    try:
        smp.resume_from_checkpoint(path, "a")
        cost = runtime.current().resume.costs["model"]
        bad = error_of(smp.resume_from_checkpoint, path, "a", staging="disk", staging_bucket=0)
        smp.init({"tensor_parallel_degree": 2, "checkpoint_staging": "journal"})
        smp.resume_from_checkpoint(path, "a")  # armed: waits for the model, then for the optimizer
        smp.DistributedModel(GPT2LMHeadModel(cfg()))
        smp.barrier()
        waiting = _journals(journal_dir)
        smp.barrier()  # every rank listed before any drops its journal
        smp.resume_from_checkpoint(path, "a", load_optimizer=False)  # replaces the waiting one
        smp.barrier()
        left = _journals(journal_dir)
    finally:
        tempfile.tempdir = None
    return {"mode": cost.mode, "peak": cost.in_memory, "bad": bad, "waiting": waiting, "left": left}


def test_config_keys_choose_the_journal_and_bad_values_are_refused(tmp_path):
    (tmp_path / "j").mkdir()
    for r in harness.run(2, from_config, str(tmp_path / "ck"), str(tmp_path / "j")):
        assert r["mode"] == "journal" and r["peak"] <= 4096 + 16 * 48 * 4, r
        assert r["bad"].startswith("ValueError: resume_from_checkpoint: staging must be one of"), r["bad"]
        assert "staging bucket must be a number of bytes >= 1, got 0" in r["bad"], r["bad"]
        assert len(r["waiting"]) == 2, f"each rank's model journal while the optimizer waits: {r['waiting']}"
        assert r["left"] == [], f"a replaced resume left its journal: {r['left']}"
