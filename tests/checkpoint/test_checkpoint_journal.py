"""Resumes in journal mode (checkpoint/load/journal.py): bounded memory, still all or nothing.

With the undo journal forced and a bucket of a few hundred bytes (so a tiny GPT-2 needs many
buckets), a resume must load exactly what the in-memory staging loads (model, optimizer slots,
hyperparameters, loss scaler; partial, full and single-file checkpoints; also resharded), and
an I/O fault after buckets were applied must leave every tensor as it was on every rank, every
rank raising the same error naming the file, no journal left behind. A failure points at
journal.py (the journal, the bucket planner), staging.py (``ModelLoad`` in journal mode),
partial_load.py (the optimizer's live slots) or full_load.py (tensor by tensor).
(Memory bounds, the automatic choice and unrecoverable journals: test_checkpoint_journal_memory.py.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import harness
import modelparallel as smp
from ckpt_helpers import build, changed, snapshot
from modelparallel import runtime
from modelparallel.checkpoint.load import journal

BUCKET = 512  # bytes: the tiny GPT-2's 16x48 c_attn alone is 3 KB, so most pieces fill a bucket


def _journals(root: str) -> list[str]:
    return sorted(p.name for p in Path(root).glob("mp-journal-*"))


def _resume_both(path: str, partial: bool, tag: str, tp_load: int, journal_dir: str) -> dict:
    """Save from seed 0 at TP=2 (or the world), resume into seed-1 models at ``tp_load``, once
    staged in memory and once through the journal: snapshots of both."""
    build(tp=min(2, torch.distributed.get_world_size()))
    smp.save_checkpoint(path, tag, partial=partial)
    out = {}
    for mode in ("memory", "journal"):
        model, optimizer = build(seed=1, tp=tp_load)
        before = snapshot(model, optimizer)
        tempfile.tempdir = journal_dir
        try:
            smp.resume_from_checkpoint(path, tag, partial=partial, staging=mode, staging_bucket=BUCKET)
        finally:
            tempfile.tempdir = None
        out[mode] = snapshot(model, optimizer)
        out[f"{mode} changed"] = len(changed(before, out[mode]))
        out[f"{mode} cost"] = runtime.current().resume.costs
    smp.barrier()
    out["left"] = _journals(journal_dir)
    return out


CASES = [(1, True, "a", 1), (2, True, "a", 2), (2, True, "a", 1), (2, False, "a", 2), (2, False, "full.pt", 2)]


@pytest.mark.parametrize("world,partial,tag,tp_load", CASES,
                         ids=["1rank", "2ranks-tp2", "2ranks-tp2-to-tp1", "full-tp2", "single-file-tp2"])
def test_journal_resume_equals_staged_resume_bit_for_bit(tmp_path, world, partial, tag, tp_load):
    (tmp_path / "j").mkdir()
    for r in harness.run(world, _resume_both, str(tmp_path / "ck"), partial, tag, tp_load, str(tmp_path / "j")):
        assert r["memory changed"] > 0, "the resume changed nothing: the comparison would prove nothing"
        assert changed(r["memory"], r["journal"]) == [], changed(r["memory"], r["journal"])[:5]
        assert r["journal cost"]["model"].mode == "journal" and r["journal cost"]["model"].journaled > 0
        assert r["memory cost"]["model"].mode == "memory", r["memory cost"]
        assert r["left"] == [], f"journals left behind: {r['left']}"


class _Watch:
    """Counts the journal's applied pieces and when the first one was applied (in the fault
    counter's numbering), by wrapping ``Journal._apply`` for one trial."""

    def __init__(self, counter):
        self.counter, self.applied, self.first, self.before_fault = counter, 0, None, 0
        self.real = journal.Journal._apply

    def __enter__(self):
        watch = self

        def apply(self, live, new, held):
            watch.applied += 1
            watch.first = watch.counter.count if watch.first is None else watch.first
            watch.before_fault += watch.counter.fired is None
            return watch.real(self, live, new, held)

        journal.Journal._apply = apply
        return self

    def __exit__(self, *exc):
        journal.Journal._apply = self.real


def _journal_ops():
    from fault_ops import FullResume, PartialResume

    class Partial(PartialResume):
        def run(self, ctx):
            smp.resume_from_checkpoint(ctx["root"], "a", staging="journal", staging_bucket=BUCKET)

    class Full(FullResume):
        def run(self, ctx):
            smp.resume_from_checkpoint(ctx["root"], "a", partial=False, staging="journal", staging_bucket=BUCKET)

    return {"partial resume": Partial(), "full resume": Full()}


def fault_series(op: str, root: str, points: list[int], victim: int, journal_dir: str) -> list[dict]:
    """test_checkpoint_faults.series for a journal-mode resume: one trial per point (0: count
    only), faults on rank ``victim``, the journal kept outside the faulted directory."""
    import shutil

    import torch.distributed as dist
    from fault_ops import start
    from faults import inject

    operation, rank, out = _journal_ops()[op], dist.get_rank(), []
    start()
    tempfile.tempdir = journal_dir
    try:
        for i, n in enumerate(points):
            trial = Path(root) / f"trial{i}"
            ctx = operation.setup(trial)
            dist.barrier()
            with inject(trial, n if rank == victim else 0, ("error", "short", "other")[n % 3]) as counter, \
                    _Watch(counter) as watch:
                try:
                    operation.run(ctx)
                    error = None
                except Exception as e:  # noqa: BLE001 - the trial records it
                    error = f"{type(e).__name__}: {e}"
            problems = operation.check(ctx, error)
            dist.barrier()
            problems += [f"journal left behind: {j}" for j in _journals(journal_dir)]
            out.append({"n": n, "fired": counter.fired, "count": counter.count, "error": error, "root": str(trial),
                        "problems": problems, "first": watch.first, "applied": watch.before_fault})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(trial, ignore_errors=True)
    finally:
        tempfile.tempdir = None
    return out


FAULT_CASES = [(op, world, victim) for op in ("partial resume", "full resume") for world in (1, 2)
               for victim in range(world)]


@pytest.mark.parametrize("op,world,victim", FAULT_CASES, ids=[f"{o}-{w}rank-fault{v}" for o, w, v in FAULT_CASES])
def test_a_fault_after_buckets_were_applied_changes_nothing(tmp_path, capsys, op, world, victim):
    from test_checkpoint_faults import _points, message_problem

    (tmp_path / "j").mkdir()
    count = harness.run(world, fault_series, op, str(tmp_path / "count"), [0], victim, str(tmp_path / "j"))[victim][0]
    assert count["first"] is not None and count["applied"] > 1, "the journal applied no bucket: nothing is tested"
    after = count["count"] - count["first"]  # calls after the first bucket was applied
    points = [count["first"] + p for p in _points(after, salt=victim)]
    results = harness.run(world, fault_series, op, str(tmp_path / "faults"), points, victim, str(tmp_path / "j"))
    bad = []
    for i, n in enumerate(points):
        trial = [r[i] for r in results]
        mine = trial[victim]
        if len({t["error"] for t in trial}) > 1:
            bad.append((n, mine["fired"], f"ranks ended differently: {sorted(str(t['error']) for t in trial)}"))
        bad += [(n, mine["fired"], p) for t in trial for p in t["problems"]]
        if (p := message_problem(mine["error"], mine)):
            bad.append((n, mine["fired"], p))
        if mine["error"] and mine["applied"] == 0:
            bad.append((n, mine["fired"], "no bucket was applied before the fault: the point tests nothing"))
    failed = sum(1 for t in results[victim] if t["error"])
    with capsys.disabled():
        print(f"\n  journal fault points: {op}, {world} rank(s), faults on rank {victim}: {len(points)} of the "
              f"{after} calls after the first bucket ({failed} failed the resume)")
    assert failed > 0, "no fault failed the resume"
    assert not bad, "\n".join(f"call {n} ({fired}): {p}" for n, fired, p in bad[:15])


def _resume_fp16(path: str, journal_dir: str) -> dict:
    """An fp16 job (half-precision weights, fp32 master weights): resumed staged in memory and
    through the journal, the results compared with everything the optimizer holds."""
    from test_checkpoint_side_effects import build as build_half, step

    model, optimizer = build_half(0, True)
    step(model, optimizer, 0)
    smp.save_checkpoint(path, "a")
    out = {"masters": len(optimizer.master_weights)}
    for mode in ("memory", "journal"):
        model, optimizer = build_half(1, True)
        step(model, optimizer, 1)
        tempfile.tempdir = journal_dir
        try:
            smp.resume_from_checkpoint(path, "a", staging=mode, staging_bucket=BUCKET)
        finally:
            tempfile.tempdir = None
        masters = {f"master{i}": (m.to_local() if hasattr(m, "to_local") else m).detach().clone()
                   for i, (p, m) in enumerate(optimizer.master_weights.params_and_masters()) if m is not p}
        out[mode] = {**snapshot(model, optimizer), **masters}
        out[f"{mode} cost"] = runtime.current().resume.costs
    slots = [t for s in optimizer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in slots] + list(masters.values())
    out["live bytes"] = sum(t.numel() * t.element_size() for t in local)
    return out


def test_fp16_journal_resume_equals_staged_resume(tmp_path):
    for r in harness.run(2, _resume_fp16, str(tmp_path / "ck"), str(tmp_path)):
        assert r["masters"] > 0, "the fp16 job has no master weights: the test would not cover them"
        assert changed(r["memory"], r["journal"]) == [], changed(r["memory"], r["journal"])[:5]
        assert r["journal cost"]["optimizer"].mode == "journal", r["journal cost"]
        journaled = r["journal cost"]["optimizer"].journaled
        assert journaled == r["live bytes"], f"the journal must take every live slot and master: {journaled} " \
            f"bytes journaled, {r['live bytes']} live"
