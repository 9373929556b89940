"""Kill trials for checkpoints: SIGKILL one rank at a random point of a save or of retention,
then check that the newest visible checkpoint loads bit-exactly and that no process hangs.

Run as a script (``python tests/checkpoint/checkpoint_kill.py --trials 20 --seed 0 DIR``); the test suite
runs a short series, ``bench/soak_checkpoint_kill.py`` a long one. The driver imports torch once
and forks a 2-rank job (TP=2, gloo) per trial, so a trial costs well under a second of start-up.

A trial job resumes from ``newest`` (if any, checking the resumed state against what was saved),
then twice: trains one AdamW step, writes the expected gathered state aside, saves with
``num_kept_partial_checkpoints=2`` (with ``--async``: ``async_save=True``, so the kills land in
the background writer while training goes on; the job waits for its last save at the end; with
``--full``: full checkpoints, ``partial=False``, model weights only). One rank dies by SIGKILL
either at its n-th file-system event (mkdir, fsync, rename, replace, unlink, rmtree; n seeded and
drawn over the events a calibration trial counted) or after a seeded random delay sent by the driver. The driver then
requires the other rank to exit within ``SURVIVOR_LIMIT_S`` and, without any process group,
verifies every visible checkpoint's checksums and loads the newest with DCP, comparing every
tensor with ``torch.equal``.

The job's side (what runs in each forked rank) is in ``kill_job.py``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: an OpenMP pool in the driver is not fork-safe
import torch  # noqa: E402

from kill_job import ASYNC_ENV, FULL_ENV, _job  # noqa: E402

SURVIVOR_LIMIT_S = 45.0


def _fork_rank(rank: int, root: Path, trial: int, kill_at: int, store: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        log = os.open(root / "logs" / f"trial{trial}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for stacks of a hang
        _job(rank, root, trial, kill_at, store)
    except BaseException:  # noqa: BLE001 - a child reports through its exit code and log
        import traceback

        traceback.print_exc()
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait_all(pids: dict[int, int], limit_s: float) -> tuple[dict[int, int], float]:
    """Reap the job's ranks: {rank: exit code (negative: signal)} and the seconds waited. Ranks
    still alive after ``limit_s`` are hung: they are killed and reported as code None."""
    codes, start = {}, time.monotonic()
    while len(codes) < len(pids) and time.monotonic() - start < limit_s:
        for rank, pid in pids.items():
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    hung = [pid for rank, pid in pids.items() if rank not in codes]
    for pid in hung:
        os.kill(pid, signal.SIGUSR1)  # Python stacks of every thread into the rank's log
    time.sleep(1.0 if hung else 0)
    for rank, pid in pids.items():
        if rank not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[rank] = None
    return codes, time.monotonic() - start


def _wait_ready(root: Path, start: float) -> float:
    """When both ranks have initialized (or ``SURVIVOR_LIMIT_S`` passed: a failed start-up)."""
    while time.monotonic() - start < SURVIVOR_LIMIT_S:
        if all((root / f"ready.{r}").exists() for r in range(2)):
            break
        time.sleep(0.005)
    return time.monotonic()


def _verify(root: Path) -> str | None:
    """Load the newest visible checkpoint without any process group; None if it is bit-exact
    (or if nothing was ever committed), else what is wrong. Every visible checkpoint must also
    pass its checksums: none may be half-written."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from modelparallel.checkpoint.safety import commit

    ckpt = root / "ckpt"
    full = os.environ.get(FULL_ENV) == "1"
    for _, name in commit.saved_checkpoints(ckpt, "" if full else "_partial") if ckpt.is_dir() else []:
        manifest = commit.read_manifest(ckpt / name)
        for rel, entry in manifest["files"].items():
            if (problem := commit.verify_file(ckpt / name, rel, entry)):
                return f"visible checkpoint {name} is incomplete: {problem}"
    newest = commit.read_newest(ckpt) if ckpt.is_dir() else None
    if newest is None:
        return None
    tag = newest.removesuffix("_partial")
    expected, got = torch.load(root / "expected" / f"{tag}.pt"), {}
    if full:
        from kill_full import model_only, read_weights

        expected, got = model_only(expected), read_weights(ckpt / newest)
    for part in () if full else ("model", "optimizer"):
        reader = dcp.FileSystemReader(ckpt / newest / part)
        meta = reader.read_metadata().state_dict_metadata
        sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
              if isinstance(m, TensorStorageMetadata)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            dcp.load(sd, storage_reader=reader, no_dist=True)
        got.update({f"{part}/{k.removeprefix('optimizer.state.')}".replace(".exp_", "/exp_")
                    .replace(".step", "/step"): v for k, v in sd.items()})
    bad = [k for k, v in expected.items() if k not in got or not torch.equal(v, got[k])]
    return f"newest {newest} differs from what was saved in {bad[:5]}" if bad else None


def plan_kill(k: int, trials: int, rng: random.Random, events: dict[int, int]) -> tuple[str, int, int]:
    """(mode, victim, event number) of kill trial ``k`` of ``trials``: even trials kill at a file
    event, odd ones by timer. Event kills alternate ranks and are stratified over each rank's
    event count, so the series reaches every phase (staging, DCP writes, checksums, commit,
    ``newest``, retention) instead of clustering where most events are."""
    if k % 2:
        return "timer", rng.randrange(2), 0
    e = k // 2
    victim, j = e % 2, e // 2
    event_trials = (trials + 1) // 2
    per_rank = (event_trials - victim + 1) // 2
    return "event", victim, 1 + int((j + rng.random()) / per_rank * events[victim])


def run_trial(root: Path, trial: int, rng: random.Random, calibration: dict, kill: tuple = ("none", 0, 0)) -> dict:
    """One job, killed as ``kill`` = (mode, victim, event) says; returns the trial's record
    (``ok`` False on any failure)."""
    mode, victim, kill_at = kill
    store = str(root / "stores" / f"store{trial}")
    start = time.monotonic()
    for r in range(2):
        (root / f"ready.{r}").unlink(missing_ok=True)
    pids = {r: _fork_rank(r, root, trial, kill_at if r == victim else 0, store) for r in range(2)}
    ready = _wait_ready(root, start)
    delay = rng.uniform(0.0, calibration["seconds"]) if mode == "timer" else None
    if delay is not None:
        time.sleep(delay)
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            pass
    codes, waited = _wait_all(pids, SURVIVOR_LIMIT_S)
    record = {"trial": trial, "mode": mode, "victim": victim, "kill_at_event": kill_at or None,
              "delay_s": delay, "exit_codes": codes, "seconds": round(time.monotonic() - start, 2),
              "seconds_after_ready": round(time.monotonic() - ready, 2)}
    note = root / "logs" / f"trial{trial}.killed_at"
    record["killed_at"] = note.read_text() if note.exists() else None
    problem = None
    if None in codes.values():
        problem = f"a rank hung for {SURVIVOR_LIMIT_S}s after its peer died"
    elif mode == "none" and any(codes.values()):
        problem = f"an uninterrupted job failed: exit codes {codes} (see logs/trial{trial}.rank*.log)"
    elif any(c not in (0, 3, -signal.SIGKILL) for c in codes.values()):
        problem = f"unexpected exit codes {codes}"
    problem = problem or _verify(root)
    record.update(ok=problem is None, problem=problem)
    if problem:
        record["logs"] = {r: (root / "logs" / f"trial{trial}.rank{r}.log").read_text()[-3000:] for r in range(2)}
    return record


def _calibrate(root: Path) -> dict:
    """Two clean jobs; the second (which resumes and applies retention) sets the ranges."""
    recs = [run_trial(root, t, random.Random(t), {}) for t in (0, 1)]
    if not all(r["ok"] for r in recs):
        raise SystemExit(f"calibration trial failed: {[r['problem'] for r in recs]}")
    events = {r: int((root / f"events.{r}").read_text()) for r in range(2)}
    return {"events": events, "seconds": recs[1]["seconds_after_ready"], "records": recs}


def run_series(root: Path, trials: int, seed: int) -> list[dict]:
    """A calibration job, ``trials`` kill trials, then a clean job that must leave no leftovers."""
    for sub in ("ckpt", "expected", "logs", "stores"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    calibration = _calibrate(root)
    rng = random.Random(seed)
    records = calibration["records"]
    records += [run_trial(root, k + 2, rng, calibration, plan_kill(k, trials, rng, calibration["events"]))
                for k in range(trials)]
    final = run_trial(root, trials + 2, rng, {})
    leftovers = [p.name for p in (root / "ckpt").iterdir() if p.name.startswith(".") and p.name != ".mp-lock"]
    if final["ok"] and leftovers:
        final.update(ok=False, problem=f"leftovers after a clean save: {leftovers}")
    return records + [final]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="working directory (created; checkpoints and logs go here)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="save with async_save=True (kills land in the background writer)")
    p.add_argument("--full", action="store_true", help="save full checkpoints (partial=False)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the trial records here")
    args = p.parse_args(argv)
    if args.asynchronous:
        os.environ[ASYNC_ENV] = "1"  # read by every forked job
    if args.full:
        os.environ[FULL_ENV] = "1"
    records = run_series(args.dir, args.trials, args.seed)
    failed = [r for r in records if not r["ok"]]
    killed = [r for r in records if r["mode"] != "none"]
    summary = {"trials": args.trials, "seed": args.seed, "failed": len(failed), "killed": len(killed),
               "events_killed_at": sorted({r["killed_at"].split()[0] for r in killed if r["killed_at"]}),
               "max_survivor_exit_s": max((r["seconds_after_ready"] - (r["delay_s"] or 0) for r in killed
                                           if r["mode"] == "timer"), default=None),
               "records": records}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    for r in failed:
        print(f"trial {r['trial']} ({r['mode']}, victim {r['victim']}): {r['problem']}")
        for rank, code in r["exit_codes"].items():
            if code is None:  # a hung rank's log ends with its threads' stacks
                print(f"--- rank {rank}'s log (end) ---\n{r['logs'][int(rank)][-2500:]}")
    print(f"{len(records) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from transformers import GPT2LMHeadModel  # noqa: F401 - imported once here, shared by every forked job

    import modelparallel  # noqa: F401
    raise SystemExit(main())
