"""``modelparallel train`` outside any launcher: start this machine's ranks, then say how it ended.

Success prints nothing more (rank 0 printed the summary). A failure prints the first failing
rank's error and the log file with every traceback; Ctrl-C prints the step reached and the
checkpoint a rerun with ``--resume`` continues from, a SIGTERM (``kill``, a scheduler's preemption)
the same with "stopped by SIGTERM". Exit status: 0, 1 (failure), 130 (Ctrl-C), 143 (SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

from . import launch, out_lock, outcome, resume, status_dir


def _say(text: str) -> None:
    # starts on a new line: the progress bar may have been left mid-line
    print(f"\n{text}", file=sys.stderr, flush=True)


def launch_ranks(args: argparse.Namespace) -> int:
    """Run the ranks of this machine and report their end; returns the exit status."""
    try:  # what the checks cannot foresee (/proc, a full disk, a race with another process)
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"modelparallel train: error: --out {args.out} cannot be created ({exc.strerror or exc}); "
              "choose another --out", file=sys.stderr)
        return 2
    lock, owner = out_lock.take(args.out) if args.node_rank == 0 else (None, None)  # machine 0 writes the metrics
    if owner is not None:  # since the check: two launches at once
        print(f"modelparallel train: error: --out {args.out}: another job is writing into it ({owner}); one job per "
              "--out: wait for it to end or choose another --out", file=sys.stderr)
        return 2
    try:
        return _launch(args)
    finally:
        if lock is not None:
            os.close(lock)


def _launch(args: argparse.Namespace) -> int:
    nodes = launch.Nodes(args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint)
    world = args.nproc * args.nnodes
    where = "" if args.nnodes == 1 else f" on this machine (node {args.node_rank} of {args.nnodes}, {world} in all)"
    start = "step 0" if args.resume_tag is None else f"checkpoint {args.resume_tag}"
    shape = "".join(f"{k} {getattr(args, k, 1)}, " for k in ("pp", "cp", "ep") if getattr(args, k, 1) > 1)
    print(f"modelparallel train: launching {args.nproc} ranks{where} (tp {args.tp}, {shape}dp "
          f"{world // (args.tp * args.pp * args.cp)}, "
          f"{launch.rank_env(args.nproc)['OMP_NUM_THREADS']} thread(s) each), from {start}",
          file=sys.stderr, flush=True)
    launch.warn_oversubscribed("train", args.nproc)
    for note in getattr(args, "resume_notes", []):
        print(f"modelparallel train: {note}", file=sys.stderr, flush=True)
    status = status_dir.create("train")
    try:
        exc = launch.torchrun(nodes, args.argv, {outcome.STATUS_ENV: str(status),
                                                 resume.TAG_ENV: args.resume_tag or ""})
        return 0 if exc is None else _report(args, exc, status)
    finally:
        shutil.rmtree(status, ignore_errors=True)


def _newest_step(args: argparse.Namespace) -> str:
    from ..checkpoint.safety import commit

    ckpt_dir = resume.checkpoint_dir(args.out)
    newest = commit.read_newest(ckpt_dir) if ckpt_dir.is_dir() else None
    if newest is None:
        return ("no checkpoint saved yet (--save-every N saves one every N steps); a rerun starts from step 0")
    tag = newest.removesuffix(resume.PARTIAL)
    step = resume.tag_step(tag)
    return f"newest checkpoint step {step if step is not None else tag}; rerun with --resume"


def _report(args: argparse.Namespace, exc: BaseException, status: Path) -> int:
    sig = outcome.stopping_signal(exc)
    ending = outcome.Ending.read(status, interrupted=sig == signal.SIGINT)
    if ending.interrupted or sig is not None:
        step = ending.step()
        what = "interrupted" if sig in (None, signal.SIGINT) else f"stopped by {sig.name}"
        at = f" at step {step}" if step is not None else " before the first step"
        try:  # reading ``newest`` imports the checkpoint package: seconds, in which Ctrl-C comes again
            newest = _newest_step(args)
        except KeyboardInterrupt:
            newest = "rerun with --resume to continue from the newest checkpoint, if one was saved"
        _say(f"{what}{at}; {newest}")
        return outcome.signal_exit(sig)
    errors = outcome.killed_ranks(exc, {r["rank"] for r in ending.records}) + ending.errors()
    if not ending.errors():
        errors = errors or [outcome.from_torchrun(exc)]
        log = None
    else:
        log = outcome.write_log(args.out / "failure.log", errors)
    _say(outcome.failure_block(errors[0], log, len(errors), _hint(args, errors[0])))
    return 1


def _hint(args: argparse.Namespace, first: dict) -> str:
    """For a failed resume: the checkpoints a rerun could use instead."""
    if args.resume_tag is None or ("Checkpoint" not in first["type"] and first["step"] is not None):
        return ""
    from .presets import load_config

    try:  # only checkpoints of the model this run builds: the others fail the same way
        others = resume.matching_tags(args.out, load_config(args.model, args.seq_len), skip=args.resume_tag)
    except (OSError, ValueError):
        others = resume.intact_tags(resume.checkpoint_dir(args.out), skip=args.resume_tag)
    return (f"intact checkpoints: {', '.join(others)} (rerun with --resume-from {others[0]})" if others
            else "")
