"""``modelparallel train``: train or fine-tune a causal LM with tensor parallelism on text files.

With no arguments it trains a tiny GPT-2 from scratch on the Python standard library's own
source at tensor-parallel degree 2, on CPU, in a few minutes: a smoke test of the whole stack
(sharding, vocab-parallel loss, optimizer, generate) that needs no GPU, download or data.
Outside torchrun it starts ``--nproc`` ranks itself; under torchrun it is one of the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import launch
from .data import default_data_path, find_text_files
from .presets import DEFAULT_PRESET, PRESETS, load_config, load_tokenizer, size_problems

HELP = "train / fine-tune a causal LM with tensor parallelism (default: tiny GPT-2 on the stdlib, TP=2, CPU)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``train`` options; defaults are the embedded CPU demo."""
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=DEFAULT_PRESET,
                   help=f"a preset ({', '.join(PRESETS)}) trained from scratch with a byte tokenizer, or a "
                        "local Hugging Face model directory to fine-tune (default: %(default)s)")
    g.add_argument("--data", nargs="+", metavar="PATH",
                   help="text files or directories, searched recursively for *.py, *.txt, *.md "
                        "(default: the Python standard library's .py files)")
    g.add_argument("--max-files", type=int, default=None, help="read at most this many files")
    g.add_argument("--max-bytes", type=float, default=8e6,
                   help="stop reading after this many bytes of text (default: %(default).0e; 0 = no limit)")
    g.add_argument("--val-fraction", type=float, default=0.02,
                   help="held-out tail of the corpus for validation (default: %(default)s)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default: %(default)s)")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to launch; a multiple of --tp, the rest is data parallel (default: --tp)")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=600, help="optimizer steps (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel rank and step")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: 5%% of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--seed", type=int, default=1234, help="model init, data order and sampling seed")
    g.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="training precision: bf16/fp16 compute with fp32 master weights in the optimizer, "
                        "fp16 with dynamic loss scaling (default: %(default)s)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-every", type=int, default=0, help="save a partial checkpoint every N steps "
                   "under OUT/checkpoints (default: never)")
    g.add_argument("--keep", type=int, default=None, help="keep only the N newest partial checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/newest if present")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", type=int, default=None,
                   help="validate every N steps (default: 4 times per run; 0 = only at the end)")
    g.add_argument("--eval-windows", type=int, default=32, help="held-out sequences per validation")
    g.add_argument("--prompt", default="def ", help="prompt of the generated sample (default: %(default)r)")
    g.add_argument("--sample-tokens", type=int, default=200, help="tokens to generate (0 = no sample)")
    g.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    g.add_argument("--out", type=Path, default=Path("runs/train"),
                   help="output directory for metrics.json and loss.png (default: %(default)s)")


def _range_problems(args: argparse.Namespace) -> list[str]:
    checks = [("--tp", args.tp, 1), ("--nproc", args.nproc, 1), ("--steps", args.steps, 1),
              ("--batch-size", args.batch_size, 1), ("--seq-len", args.seq_len, 2),
              ("--eval-windows", args.eval_windows, 1), ("--sample-tokens", args.sample_tokens, 0),
              ("--max-files", args.max_files or 1, 1), ("--eval-every", args.eval_every or 0, 0),
              ("--max-bytes", args.max_bytes, 0), ("--warmup", args.warmup or 0, 0)]
    problems = [f"{name} must be >= {low}, got {value}" for name, value, low in checks if value < low]
    if args.lr <= 0:
        problems.append(f"--lr must be positive, got {args.lr}")
    if not 0 < args.val_fraction < 0.5:
        problems.append(f"--val-fraction must be in (0, 0.5), got {args.val_fraction}")
    if args.sample_tokens and not args.prompt:
        problems.append("--prompt must not be empty when --sample-tokens > 0")
    if args.temperature < 0:
        problems.append(f"--temperature must be >= 0, got {args.temperature}")
    return problems


def _world_problems(args: argparse.Namespace) -> list[str]:
    """The launch shape: ``--tp`` must divide the number of ranks, whoever launches them."""
    world = int(os.environ["WORLD_SIZE"]) if launch.under_launcher() else args.nproc
    where = "the launcher's WORLD_SIZE" if launch.under_launcher() else "--nproc"
    if args.tp >= 1 and world >= 1 and world % args.tp:
        return [f"--tp {args.tp} does not divide {where} {world}"]
    return []


def check_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments, found before any rank starts (so it is reported once,
    not as one traceback per rank). Fills in defaults that depend on other arguments."""
    if args.nproc is None:
        args.nproc = args.tp
    problems = _range_problems(args) + _world_problems(args)
    try:
        args.data_files = find_text_files(args.data) if args.data else \
            find_text_files([default_data_path()], suffixes=(".py",))
    except (FileNotFoundError, ValueError) as exc:
        problems.append(str(exc))
    try:
        problems += size_problems(load_config(args.model, args.seq_len), args.seq_len, args.tp)
        load_tokenizer(args.model)
    except (OSError, ValueError) as exc:
        problems.append(str(exc))
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 4)
    return problems


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the arguments, then launch the ranks or, as a rank (or a world of one), train."""
    problems = check_args(args)
    if problems:
        parser.error("\n  ".join(["invalid arguments:", *problems]))
    if not launch.under_launcher() and args.nproc > 1:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"modelparallel train: launching {args.nproc} ranks (tp {args.tp}, dp {args.nproc // args.tp}, "
              f"{launch.rank_env(args.nproc)['OMP_NUM_THREADS']} thread(s) each)", file=sys.stderr, flush=True)
        return launch.relaunch(args.nproc, args.argv)
    from .train_job import run_job

    return run_job(args)
