"""``modelparallel train``: train or fine-tune a causal LM with tensor parallelism on text files.

With no arguments it trains a tiny GPT-2 from scratch on the Python standard library's own
source at tensor-parallel degree 2, on CPU, in a few minutes: a smoke test of the whole stack
(sharding, vocab-parallel loss, optimizer, generate) that needs no GPU, download or data. On a
machine with GPUs each rank takes one (``cuda:LOCAL_RANK``, NCCL) and the default degree is at
most the GPUs it has (1 on a one-GPU machine); ``MODELPARALLEL_DEVICE=cpu`` keeps a run on CPU.
Outside torchrun it starts ``--nproc`` ranks itself (on several machines: the same command on
each with ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``) and reports how they ended: a failure
as the first failing rank's error and the file holding every traceback (exit status 1), Ctrl-C as
the step reached and the checkpoint a rerun with ``--resume`` continues from (exit status 130;
143 for a SIGTERM).
Problems found before launch exit with status 2. Under torchrun it is one of the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..config import Config, unbuilt_combinations
from . import checks, launch, outcome, resume, user_path
from .corpus import default_data_path, find_text_files, select_files
from .presets import (DEFAULT_PRESET, PRESETS, causal_lm_problems, load_config, load_tokenizer, preset_shape,
                      size_problems)

HELP = ("train / fine-tune a causal LM with tensor and pipeline parallelism (default: tiny GPT-2 on the stdlib, "
        "TP=2 on CPU, one rank per GPU up to TP=2 on a GPU machine)")

DEFAULT_TP = 2
DEVICE_ENV = "MODELPARALLEL_DEVICE"
"""``devices.DEVICE_ENV``, named here for the help text: ``devices`` imports torch, and parsing the
arguments (``--help``) needs none of it."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``train`` options; defaults are the embedded CPU demo."""
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=DEFAULT_PRESET, type=os.path.expanduser,
                   help=f"a preset ({', '.join(PRESETS)}) trained from scratch with a byte tokenizer, or a "
                        "local Hugging Face model directory to fine-tune (default: %(default)s)")
    g.add_argument("--data", nargs="+", metavar="PATH", type=os.path.expanduser,
                   help="text files or directories, searched recursively for *.py, *.txt, *.md "
                        "(default: the Python standard library's .py files)")
    g.add_argument("--max-files", type=int, default=None, help="read at most this many files")
    g.add_argument("--max-bytes", type=float, default=8e6,
                   help="stop reading after this many bytes of text (default: %(default).0e; 0 = no limit)")
    g.add_argument("--val-fraction", type=float, default=0.02,
                   help="held-out tail of the corpus for validation (default: %(default)s)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=None,
                   help=f"tensor-parallel degree (default: {DEFAULT_TP}, or the number of GPUs PyTorch sees when "
                        f"that is fewer: 1 on a one-GPU machine). Each rank takes one GPU (cuda:LOCAL_RANK) when "
                        f"PyTorch sees any, else runs on CPU with gloo; {DEVICE_ENV}=cpu keeps a run on CPU")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages: each holds a contiguous range of layers "
                   "(default: %(default)s)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step, which the pipeline overlaps (default: 2 x --pp at --pp > 1, else 1)")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree: every sequence split over this many ranks, which hold "
                        "chunks r and 2cp-1-r of it (--seq-len must divide by 2 x --cp; no sample is "
                        "generated at --cp > 1) (default: %(default)s)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree, for mixture-of-experts models (mixtral-* presets, Mixtral, "
                        "Qwen2-MoE): data-parallel ranks sharing each layer's experts (default: %(default)s)")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to launch on this machine; --nproc x --nnodes must be a multiple of --tp x --pp x "
                        "--cp x --ep, the rest is data parallel (default: --tp x --pp x --cp x --ep / --nnodes)")
    g = p.add_argument_group("several machines (passed to torchrun; run the same command on each)")
    g.add_argument("--nnodes", type=int, default=1, help="number of machines (default: %(default)s)")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None,
                   help="where the machines meet: a free port on the node-rank-0 machine")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=600, help="optimizer steps (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel rank and step; the global batch is --batch-size x the "
                   "data-parallel degree, drawn alike at every layout, so runs of one global batch and "
                   "seed train on the same windows")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: 5%% of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--seed", type=int, default=1234, help="model init, data order and sampling seed (0..2^32-1)")
    g.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="training precision: bf16/fp16 compute with fp32 master weights in the optimizer, "
                        "fp16 with dynamic loss scaling (default: %(default)s)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-every", type=int, default=0, help="save a partial checkpoint every N steps "
                   "under OUT/checkpoints (default: never)")
    g.add_argument("--keep", type=int, default=None, help="keep only the N newest partial checkpoints")
    g.add_argument("--sync-save", action="store_true",
                   help="write each checkpoint before training goes on (default: staged to host memory, then "
                        "written and committed in the background while training continues)")
    g.add_argument("--resume", nargs="?", const="newest", choices=("newest", "auto"), default=None,
                   metavar="auto", help="--resume: continue from the newest checkpoint in OUT/checkpoints "
                   "(an error if there is none); --resume auto: continue if there is one, else start fresh")
    g.add_argument("--resume-from", metavar="TAG", default=None,
                   help="continue from checkpoint TAG (e.g. step400) instead of the newest")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", type=int, default=None,
                   help="validate every N steps (default: 4 times per run; 0 = only at the end)")
    g.add_argument("--eval-windows", type=int, default=32, help="held-out sequences per validation")
    g.add_argument("--prompt", default="def ", help="prompt of the generated sample (default: %(default)r)")
    g.add_argument("--sample-tokens", type=int, default=200, help="tokens to generate (0 = no sample)")
    g.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    g.add_argument("--out", type=user_path, default=Path("runs/train"),
                   help="output directory: metrics.json, loss.png, checkpoints/, failure.log (default: %(default)s)")


def _unbuilt_layout(args: argparse.Namespace) -> list[str]:
    """The combinations of --pp, --cp, --ep the library does not compose (its own answer, so the
    command line refuses exactly what ``smp.init`` would, before launch)."""
    degrees = (args.pp, args.cp, args.ep, args.tp, args.nproc)
    if min(degrees) < 1:
        return []  # reported by the range checks
    cfg = Config(pipeline_parallel_degree=args.pp, context_parallel_degree=args.cp, expert_parallel_degree=args.ep,
                 tensor_parallel_degree=args.tp, world_size=args.nproc)
    return [f"not implemented: {r}" for r in unbuilt_combinations(cfg)]


def _range_problems(args: argparse.Namespace) -> list[str]:
    checks = [("--tp", args.tp, 1), ("--pp", args.pp, 1), ("--microbatches", args.microbatches, 1),
              ("--cp", args.cp, 1), ("--ep", args.ep, 1), ("--nproc", args.nproc, 1), ("--steps", args.steps, 1),
              ("--batch-size", args.batch_size, 1), ("--seq-len", args.seq_len, 2),
              ("--eval-windows", args.eval_windows, 1), ("--sample-tokens", args.sample_tokens, 0),
              ("--max-files", _given(args.max_files, 1), 1), ("--eval-every", _given(args.eval_every, 0), 0),
              ("--max-bytes", args.max_bytes, 0), ("--warmup", _given(args.warmup, 0), 0),
              ("--save-every", args.save_every, 0), ("--keep", _given(args.keep, 1), 1), ("--nnodes", args.nnodes, 1)]
    problems = [f"{name} must be >= {low}, got {value}" for name, value, low in checks if value < low]
    if args.out.exists() and not args.out.is_dir():
        problems.append(f"--out {args.out} is a file; it must be a directory (created if missing)")
    if args.lr <= 0:
        problems.append(f"--lr must be positive, got {args.lr}")
    if not 0 < args.val_fraction < 0.5:
        problems.append(f"--val-fraction must be in (0, 0.5), got {args.val_fraction}")
    if args.cp >= 1 and args.seq_len >= 2 and args.seq_len % (2 * args.cp):
        problems.append(f"--seq-len {args.seq_len} is not divisible by 2 x --cp = {2 * args.cp} (each "
                        "context-parallel rank holds two equal chunks of every sequence)")
    problems += _unbuilt_layout(args)
    if args.sample_tokens and not args.prompt:
        problems.append("--prompt must not be empty when --sample-tokens > 0")
    if args.microbatches >= 1 and args.batch_size % args.microbatches:
        problems.append(f"--microbatches {args.microbatches} does not divide --batch-size {args.batch_size}")
    if args.temperature < 0:
        problems.append(f"--temperature must be >= 0, got {args.temperature}")
    if not -2**31 <= args.seed < 2**32:  # the data order's generator takes seed x 1000003 as a 64-bit integer
        problems.append(f"--seed must be in {-2**31}..{2**32 - 1}, got {args.seed}")
    if not 0 <= args.node_rank < max(args.nnodes, 1):
        problems.append(f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        problems.append(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (a free port on the node-rank-0 machine)")
    if args.rdzv_endpoint and not args.rdzv_endpoint.rpartition(":")[2].isdigit():
        problems.append(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")
    return problems


def model_shape(args: argparse.Namespace) -> str:
    """``--tp`` x ``--pp`` x ``--cp`` as the user wrote it (the degrees above 1 beside --tp), with the product."""
    parts = [f"--tp {args.tp}"] + [f"--{k} {getattr(args, k)}" for k in ("pp", "cp") if getattr(args, k) != 1]
    return parts[0] if len(parts) == 1 else " x ".join(parts) + f" = {args.tp * args.pp * args.cp}"


def _given(value, default):
    """An optional option's value, or ``default`` when it was not given (0 is a value)."""
    return default if value is None else value


def _corpus_problems(args: argparse.Namespace) -> list[str]:
    """A corpus that cannot hold a training and a validation window of ``--seq-len`` tokens,
    found before launch: a token covers at least one byte, so the files' total size bounds the
    token count from above."""
    files = select_files(args.data_files, args.max_files)
    total = sum(f.stat().st_size for f in files)
    need = 2 * (args.seq_len + 1)
    if total < need:
        return [f"--seq-len {args.seq_len}: the corpus ({len(files)} file(s), {total} bytes) cannot hold a training "
                f"and a validation window of {args.seq_len + 1} tokens (needs at least {need}); lower --seq-len "
                "or add --data files"]
    return []


def _world_problems(args: argparse.Namespace) -> list[str]:
    """The launch shape: ``--tp`` x ``--pp`` x ``--cp`` (x ``--ep``) must divide the number of ranks,
    whoever launches them."""
    world = int(os.environ["WORLD_SIZE"]) if launch.under_launcher() else args.nproc * args.nnodes
    where = "the launcher's WORLD_SIZE" if launch.under_launcher() else \
        "--nproc" if args.nnodes == 1 else f"--nproc x --nnodes = {args.nproc} x {args.nnodes} ="
    model = model_shape(args)
    ranks = args.tp * args.pp * args.cp
    if args.tp >= 1 and args.pp >= 1 and args.cp >= 1 and world >= 1 and world % ranks:
        return [f"{model} does not divide {where} {world}"]
    if args.tp >= 1 and args.pp >= 1 and args.cp >= 1 and args.ep > 1 and world >= 1 and world % (ranks * args.ep):
        return [f"{model} x --ep {args.ep} does not divide {where} {world} (expert-parallel ranks are "
                "data-parallel ranks)"]
    return []


def default_tp() -> int:
    """``DEFAULT_TP``, or the GPUs this machine shows when fewer (one rank per GPU): the default
    command runs as it is on a one-GPU machine (a bad ``MODELPARALLEL_DEVICE`` is reported by
    ``_device_problems``)."""
    from .. import devices

    try:
        gpus = devices.gpu_count()
    except ValueError:
        return DEFAULT_TP
    return min(DEFAULT_TP, gpus) if gpus else DEFAULT_TP


def _device_problems(args: argparse.Namespace) -> list[str]:
    """More ranks on this machine than GPUs, when it has GPUs: each rank takes ``cuda:LOCAL_RANK``."""
    from .. import devices

    if launch.under_launcher():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        return devices.launch_problems(local, "start fewer ranks per machine (torchrun --nproc-per-node)")
    return devices.launch_problems(max(args.nproc, 1), "lower --nproc (the ranks per machine, by default --tp x --pp "
                                   "x --cp x --ep / --nnodes), or spread them over machines with --nnodes")


def _model_problems(args: argparse.Namespace) -> list[str]:
    """The model must be a causal LM that the run's shape fits, with a tokenizer (a preset's
    shape is read without transformers: ``preset_shape``)."""
    try:
        config = (preset_shape if args.model in PRESETS else load_config)(args.model, args.seq_len)
        problems = causal_lm_problems(args.model, config)
        if problems:
            return problems
        tokenizer = load_tokenizer(args.model)
        return size_problems(config, args.seq_len, args.tp, args.pp, args.ep) + \
            checks.sample_problems(args, config, tokenizer)
    except (OSError, ValueError) as exc:
        return [str(exc)]


def _resume_problems(args: argparse.Namespace) -> list[str]:
    """Sets ``args.resume_tag``: the launcher chooses (reading the checkpoint's files once; the
    ranks' load verifies them again) and its ranks take its choice, so they resume exactly it."""
    chosen, args.resume_tag = resume.launcher_choice() if launch.under_launcher() else (False, None)
    if chosen:
        return []
    args.resume_notes = []
    args.resume_tag, problems = resume.choose(args.out, args.resume, args.resume_from, args.steps,
                                              verify=not launch.under_launcher(), notes=args.resume_notes)
    if problems:
        return problems
    problems = resume.foreign_problems(args.out, args.resume_tag, args.save_every)
    if args.resume_tag is not None and args.tp >= 1:
        problems += checks.resume_model_problems(args)
    return problems


def check_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments, found before any rank starts (so it is reported once,
    not as one traceback per rank). Fills in defaults that depend on other arguments, and
    ``args.resume_tag``: the checkpoint to continue from (None: from step 0)."""
    if args.tp is None:
        args.tp = default_tp()
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    if args.nproc is None:
        args.nproc = max(1, args.tp * max(args.pp, 1) * max(args.cp, 1) * max(args.ep, 1) // max(args.nnodes, 1))
    problems = _range_problems(args) + checks.value_problems(args) + _world_problems(args) + _device_problems(args)
    try:
        args.data_files = find_text_files(args.data) if args.data else \
            find_text_files([default_data_path()], suffixes=(".py",))
    except (FileNotFoundError, ValueError) as exc:
        problems.append(str(exc))
    if getattr(args, "data_files", None) and args.seq_len >= 2:
        problems += _corpus_problems(args)
    if args.tp >= 1:  # with --tp < 1 the model's sizes cannot be checked (and --tp is already refused)
        problems += _model_problems(args)
    problems += _resume_problems(args)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 4)
    return problems


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the arguments, then launch the ranks or, as a rank, train."""
    problems = check_args(args)
    if problems:  # argparse's error format without its 15-line usage, which would bury the problems
        print("\n  ".join([f"{parser.prog}: error: invalid arguments (see {parser.prog} --help):", *problems]),
              file=sys.stderr)
        raise SystemExit(2)
    if not launch.under_launcher():
        from .train_launch import launch_ranks

        return launch_ranks(args)
    from .train_job import run_job

    return outcome.run_rank(lambda: run_job(args))
