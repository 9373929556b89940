"""An I/O fault at the N-th file-system call of every checkpoint operation, for every N (or a
sample of them), on 1 and 2 ranks: SQLite's way of proving that nothing is ever half done.

For each operation (fault_ops.py: partial and full save, partial and full resume, ``smp.load``,
``train --resume``'s ranks, v2's ``save`` and ``load``; here: the launcher's resume check and ``convert``) the calls it makes
under its directory are counted once, then the operation is run again with the N-th call failing
(faults.py: EIO / ENOSPC / EACCES, or a short read or write) on one rank. Each trial must end
with: the previous newest checkpoint intact and loading bit for bit; a failed load leaving model,
optimizer, hyperparameters and loss scaler exactly as they were; every rank raising the same
error, or none; an error whose first line names a file of the checkpoint and the cause.

By default each (operation, world, faulty rank) runs ``SAMPLE`` fault points spread over all
its calls (a few minutes in all); ``MODELPARALLEL_FAULTS=all`` runs every point,
``MODELPARALLEL_FAULTS=N`` N points. The points covered per operation are printed. A failure
lists each bad trial as (call number, the call that failed, what went wrong).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import harness
from fault_ops import OPERATIONS, start
from faults import inject

SAMPLE = 8
CHUNK = 8  # trials per call into the rank pool


def _points(count: int, salt: int) -> list[int]:
    """Which of the calls 1..count to fail: all, or evenly spread (shifted by ``salt``)."""
    want = os.environ.get("MODELPARALLEL_FAULTS", str(SAMPLE))
    if want == "all" or int(want) >= count:
        return list(range(1, count + 1))
    n = int(want)
    return sorted({1 + (i * count) // n + (salt % max(1, count // n)) for i in range(n)} & set(range(1, count + 1)))


def series(op: str, root: str, points: list[int], victim: int) -> list[dict]:
    """On every rank: one trial per fault point (0: count only), faults on rank ``victim``."""
    import torch.distributed as dist

    operation = OPERATIONS[op]
    rank = dist.get_rank()
    start()
    out = []
    for i, n in enumerate(points):
        trial = Path(root) / f"trial{i}"
        ctx = operation.setup(trial)
        dist.barrier()
        kind = ("error", "short", "other")[n % 3]
        with inject(trial, n if rank == victim else 0, kind) as counter:
            try:
                operation.run(ctx)
                error = None
            except Exception as e:  # noqa: BLE001 - the trial records it
                error = f"{type(e).__name__}: {e}"
        problems = operation.check(ctx, error)
        out.append({"n": n, "fired": counter.fired, "count": counter.count, "error": error, "problems": problems,
                    "root": str(trial)})
        dist.barrier()
        if rank == 0:
            shutil.rmtree(trial, ignore_errors=True)
    return out


def message_problem(error: str | None, record: dict) -> str | None:
    """The error's first line must name a file of the trial's directory and the cause."""
    if error is None:
        return None
    first = error.splitlines()[0]
    if record["root"] not in first:
        return f"first line names no file of the checkpoint: {first[:300]}"
    causes = ("[Errno ", "Input/output error", "No space left on device", "Permission denied", "truncated",
              "CRC32", "ended at byte", "not a complete", "unreadable")
    if not any(c in first for c in causes):
        return f"first line does not say what happened: {first[:300]}"
    return None


CASES = [(op, world, victim) for op in OPERATIONS for world in (1, 2) for victim in range(world)]


@pytest.mark.parametrize("op,world,victim", CASES, ids=[f"{o}-{w}rank-fault{v}" for o, w, v in CASES])
def test_an_io_fault_at_any_call_leaves_nothing_half_done(tmp_path, capsys, op, world, victim):
    calls = harness.run(world, series, op, str(tmp_path / "count"), [0], victim)[victim][0]["count"]
    if calls == 0 and victim > 0:  # e.g. a full save: rank 0 alone writes, so no fault can happen here
        with capsys.disabled():
            print(f"\n  fault points: {op}, {world} rank(s): rank {victim} makes no file-system call")
        return
    assert calls > 0, f"{op}: no file-system call was counted"
    points = _points(calls, salt=victim)
    results = [[] for _ in range(world)]
    for first in range(0, len(points), CHUNK):  # each run of the pool stays well within its time limit
        chunk = harness.run(world, series, op, str(tmp_path / f"faults{first}"), points[first:first + CHUNK], victim)
        for r in range(world):
            results[r] += chunk[r]
    bad = []
    for i, n in enumerate(points):
        trial = [r[i] for r in results]
        errors = {t["error"] for t in trial}
        mine = trial[victim]
        if len(errors) > 1 and getattr(OPERATIONS[op], "collective", True):
            bad.append((n, mine["fired"], f"ranks ended differently: {sorted(map(str, errors))}"))
        bad += [(n, mine["fired"], p) for t in trial for p in t["problems"]]
        if (p := message_problem(mine["error"], mine)):
            bad.append((n, mine["fired"], p))
    failed = sum(1 for t in results[victim] if t["error"])
    with capsys.disabled():
        print(f"\n  fault points: {op}, {world} rank(s), faults on rank {victim}: {len(points)} of {calls} calls "
              f"({failed} failed the operation, the others were absorbed)")
    assert not bad, "\n".join(f"call {n} ({fired}): {p}" for n, fired, p in bad[:15])


def _launcher_check(root: Path):
    """The launcher's side of ``train --resume``: ``resume.choose`` (no ranks)."""
    from modelparallel.cli import resume

    return resume.choose(root, "newest", None, 10, verify=True)


def _convert(root: Path):
    from modelparallel.cli.convert import convert

    return convert(root / "hf", root / "out", "distributed")


def _setup_single(root: Path, what: str) -> None:
    import subprocess
    import sys

    script = ("import sys, torch, modelparallel as smp\n"
              "from transformers import GPT2Config, GPT2LMHeadModel\n"
              "m = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=8))\n"
              "m.save_pretrained(sys.argv[1] + '/hf')\n"
              "if sys.argv[2] == 'launcher':\n"
              "    smp.init({'tensor_parallel_degree': 1})\n"
              "    smp.DistributedModel(m)\n"
              "    smp.save_checkpoint(sys.argv[1] + '/checkpoints', 'step2', user_content={'step': 2})\n")
    subprocess.run([sys.executable, "-c", script, str(root), what], check=True, capture_output=True,
                   env={**os.environ, "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(29600 + os.getpid() % 300)})


@pytest.mark.parametrize("what", ["launcher", "convert"])
def test_single_process_operations_under_faults(tmp_path, capsys, what):
    """``modelparallel train --resume``'s check before launch and ``modelparallel convert``: a
    fault gives a refusal or an error naming the file and the cause, never a traceback from
    deeper down, and convert leaves no weights file (nor temporaries) behind."""
    root = tmp_path / "setup"
    _setup_single(root, what)
    fn = _launcher_check if what == "launcher" else _convert
    with inject(root, 0) as counter:
        fn(root)
    calls = counter.count
    bad = []
    points = _points(calls, salt=0)
    for n in points:
        trial = tmp_path / f"t{n}"
        shutil.copytree(root, trial, ignore=shutil.ignore_patterns("out"))
        with inject(trial, n, ("error", "short", "other")[n % 3]) as counter:
            try:
                result, error = fn(trial), None
            except Exception as e:  # noqa: BLE001 - checked below
                result, error = None, f"{type(e).__name__}: {e}"
        if what == "launcher":
            tag, problems = result if result else (None, [error])
            if tag is None and not any(str(trial) in p for p in problems):
                bad.append((n, counter.fired, f"refused without naming a file: {problems}"))
            if tag not in (None, "step2"):
                bad.append((n, counter.fired, f"chose {tag!r}"))
        else:
            leftovers = sorted(p.name for p in (trial / "out").iterdir()) if (trial / "out").is_dir() else []
            if error is not None and (p := message_problem(error, {"root": str(trial)})):
                bad.append((n, counter.fired, p))
            if error is not None and any(n.endswith(".safetensors") or n.startswith(".mp-") for n in leftovers):
                bad.append((n, counter.fired, f"a failed convert left {leftovers}"))
            if error is None:
                from safetensors.torch import load_file

                got = load_file(trial / "out" / "model.safetensors")
                want = load_file(root / "out" / "model.safetensors") if (root / "out").is_dir() else got
                if sorted(got) != sorted(want) or any(not torch.equal(got[k], want[k]) for k in want):
                    bad.append((n, counter.fired, "converted weights differ"))
        shutil.rmtree(trial, ignore_errors=True)
    with capsys.disabled():
        print(f"\n  fault points: {what}, 1 process: {len(points)} of {calls} calls")
    assert not bad, "\n".join(f"call {n} ({fired}): {p}" for n, fired, p in bad[:15])
