"""Checks of ``modelparallel train`` arguments that a range check misses, run before launch.

``nan`` passes every comparison (``nan <= 0`` is false), so a bound alone lets ``--lr nan``
through to a run that trains to NaN and exits 0; ``inf`` is a float too. A port is a number
below 65536, an output directory must be creatable by this user, a preset's positions grow with
``--seq-len`` only so far, and a resumed checkpoint must hold the model being trained. Each
problem names the option, as the rest of ``check_args`` does.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from . import launch, out_lock, resume
from .presets import PRESETS, load_config, max_positions

PRESET_MAX_POSITIONS = 8192
"""Longest ``--seq-len`` a preset is built for: its position table grows with ``--seq-len`` (at
least 1024), but attention over longer windows holds seq_len^2 scores per head and batch row."""

MAX_PORT = 65535

MIN_TEMPERATURE = 1e-3
"""Lowest ``--temperature`` above 0 (greedy): the sample divides the logits by it, and a tiny one
(``1e-300``) makes them infinite, so the sample, run after all the training, would fail."""


def _finite_problems(args: argparse.Namespace) -> list[str]:
    floats = [("--lr", args.lr), ("--weight-decay", args.weight_decay), ("--max-bytes", args.max_bytes),
              ("--temperature", args.temperature)]  # --val-fraction: its range check refuses nan already
    problems = [f"{name} must be a finite number, got {value}" for name, value in floats if not math.isfinite(value)]
    if math.isfinite(args.weight_decay) and args.weight_decay < 0:
        problems.append(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if 0 < args.max_bytes < 1:  # read as int(): 0, which means no limit at all
        problems.append(f"--max-bytes must be 0 (no limit) or at least 1, got {args.max_bytes}")
    if 0 < args.temperature < MIN_TEMPERATURE:
        problems.append(f"--temperature {args.temperature} is below {MIN_TEMPERATURE}: the sample's logits divided by "
                        "it overflow; use 0 for greedy decoding")
    return problems


def _endpoint_problems(endpoint: str | None) -> list[str]:
    host, _, port = (endpoint or "").rpartition(":")
    if port.isdigit() and not 1 <= int(port) <= MAX_PORT:
        return [f"--rdzv-endpoint {endpoint}: the port must be in 1..{MAX_PORT}, got {int(port)}"]
    if endpoint and port.isdigit() and not host.strip("[]"):
        return [f"--rdzv-endpoint {endpoint}: no host before the port (HOST:PORT, the node-rank-0 machine)"]
    return []


def out_problems(out: Path, option: str = "--out") -> list[str]:
    """``out`` must be a directory this user can create (or write into): its nearest existing
    ancestor a directory (not a file) on a writable mount with write permission."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        return []  # reported by the range check
    ancestor = out.absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return [f"{option} {out}: {ancestor} is a file, so no directory can be created under it"]
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return [f"{option} {out}: {ancestor} is not writable (a read-only mount or no write permission); "
                "choose another --out"]
    return []


def _seq_len_problems(args: argparse.Namespace) -> list[str]:
    if args.model in PRESETS and args.seq_len > PRESET_MAX_POSITIONS:
        return [f"--seq-len {args.seq_len} exceeds the {PRESET_MAX_POSITIONS} positions a preset model "
                f"({args.model}) can have"]
    return []


def sample_problems(args: argparse.Namespace, config, tokenizer) -> list[str]:
    """The sample, generated after the whole run, must fit the model's positions with its prompt:
    beyond them a learned position table has no row, and the run would fail at its very end."""
    limit = max_positions(config)
    if not args.sample_tokens or args.pp > 1 or args.cp > 1 or limit is None:  # no sample at --pp/--cp > 1
        return []
    prompt = len(tokenizer.encode(args.prompt, add_special_tokens=False))
    if prompt + args.sample_tokens <= limit:
        return []
    return [f"--sample-tokens {args.sample_tokens}: with the prompt's {prompt} token(s) the sample would reach "
            f"{prompt + args.sample_tokens} positions, beyond the model's {limit}; lower --sample-tokens (0: no sample)"]


def value_problems(args: argparse.Namespace) -> list[str]:
    """Non-finite numbers, ports out of range, an ``--out`` that cannot be made or that another
    job writes into, a preset ``--seq-len`` beyond its positions."""
    return (_finite_problems(args) + _endpoint_problems(args.rdzv_endpoint) + out_problems(args.out)
            + _seq_len_problems(args) + _checkpoint_dir_problems(args) + _other_job_problems(args))


def _checkpoint_dir_problems(args: argparse.Namespace) -> list[str]:
    """A run that saves or resumes needs ``OUT/checkpoints`` to be a directory (or absent): a
    file there would fail the first save only after the ranks trained up to it."""
    ckpt = resume.checkpoint_dir(args.out)
    if not (getattr(args, "save_every", 0) or getattr(args, "resume", None) or getattr(args, "resume_from", None)):
        return []
    if (ckpt.exists() or ckpt.is_symlink()) and not ckpt.is_dir():
        return [f"--out {args.out}: {ckpt} exists and is not a directory; checkpoints are saved and resumed there: "
                "move it or choose another --out"]
    return []


def _other_job_problems(args: argparse.Namespace) -> list[str]:
    """One job per ``--out``: another live job writing there (its launcher's lock, ``out_lock``, or
    its ranks saving checkpoints) is refused, whether this run saves or only reads: every run
    writes its metrics.json, loss.png and failure.log into ``--out``, over the other job's. A rank
    of our launcher skips the first (the lock is its own launcher's), and so does the launcher of
    a machine other than the first (the first machine's launcher, of the same job, holds it)."""
    ours = launch.under_launcher() and os.environ.get(launch.LAUNCHER_PID_ENV)
    launcher = None if ours or getattr(args, "node_rank", 0) else out_lock.holder(args.out)
    ckpt = resume.checkpoint_dir(args.out)
    saver = out_lock.holder(ckpt, out_lock.CHECKPOINT_LOCK)
    if saver is not None and getattr(args, "save_every", 0):  # its ranks would fail at their first save
        return [f"--out {args.out}: another job is saving checkpoints into {ckpt} ({saver}); one writer per "
                "directory: wait for it to end or choose another --out"]
    if launcher is None and saver is None:
        return []
    what = f"another job is writing into it ({launcher})" if launcher else \
        f"another job is saving checkpoints into {ckpt} ({saver})"
    return [f"--out {args.out}: {what}; this run would overwrite that job's metrics.json and loss.png: one job per "
            "--out, so wait for it to end or choose another --out (to start from one of its checkpoints, copy "
            "OUT/checkpoints/TAG_partial into NEW_OUT/checkpoints/ and pass --resume-from TAG)"]


def resume_model_problems(args: argparse.Namespace) -> list[str]:
    """The checkpoint chosen to resume (``args.resume_tag``) must have been saved from the model
    this run builds; else the ranks' load would refuse it after launch, and so would the same
    load of every other checkpoint of that run. Offers only checkpoints of this model."""
    try:
        config = load_config(args.model, args.seq_len)
    except (OSError, ValueError):
        return []  # reported by the model check
    diffs = resume.config_problems(args.out, args.resume_tag, config)
    if not diffs:
        return []
    others = resume.matching_tags(args.out, config, skip=args.resume_tag)
    offer = (f"checkpoints of this model: {', '.join(others)} (--resume-from {others[0]})" if others else
             "resume with the --model (and --seq-len) it was saved with, or choose another --out to start fresh")
    return [f"checkpoint {args.resume_tag} was saved from another model than --model {args.model} "
            f"({'; '.join(diffs[:4])}); {offer}"]


class NonFiniteLoss(FloatingPointError):
    """The training loss became NaN or infinite: every later step would train on it."""


def finite_loss(loss: float, step: int, lr: float) -> None:
    """Stop a run whose loss at ``step`` is no longer a number. ``train`` passes the data-parallel
    mean, the same on every rank, so every rank stops at the same step (no collective is left
    waiting) and nothing of the diverged run is saved over the checkpoints on disk."""
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"the training loss is {loss} at step {step} (learning rate {lr:.3g}); training "
                            "stopped: lower --lr, and resume from a checkpoint saved before it diverged")
