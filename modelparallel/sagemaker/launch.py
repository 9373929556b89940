"""``modelparallel run [torchrun options] script.py [args]`` (also ``python -m modelparallel.run``):
a SageMaker script, unchanged, on ``torchrun``'s ranks.

The launching process parses torchrun's own options (``torch.distributed.run``'s parser, plus
``--sagemaker-dir`` and ``--channel``) and runs torchrun's agent in-process (``cli.launch``);
every rank then starts here again, sees the launcher's ``RANK`` / ``WORLD_SIZE``, and before
running the script as ``__main__``: sets SageMaker's environment variables it lacks
(``sagemaker.env``), gives the script's CUDA calls their CPU meaning on a CPU-only machine, and
installs the import hook (``sagemaker.hook``) for this process only. Started by another
launcher (``torchrun -m modelparallel.run script.py``) it does the rank part alone.

A rank whose script raises records its error and exits; the launcher stops the other ranks and
prints the first failing rank's error, with every rank's traceback in
``<sagemaker-dir>/output/failure.log``; a rank that dies without a record (``os._exit(5)``, a
crash) is named in one block with its status. Exit status: the script's (a rank's ``os._exit``
code too), 1 on failure or ``sys.exit("message")`` (its message reported), 130 on Ctrl-C, 143 on a
SIGTERM ("stopped by SIGTERM"), 2 for a
bad ``--nproc-per-node`` or when this machine has GPUs but fewer than ``--nproc-per-node`` (each
rank takes ``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import shutil
import signal
import sys
from pathlib import Path

from ..cli import launch, outcome, status_dir
from . import env, hook, torch_calls

HELP = "run a SageMaker (v1 or v2) training script unchanged, on torchrun's ranks"


def _add_sagemaker_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SageMaker environment")
    group.add_argument("--sagemaker-dir", default=None, metavar="DIR",
                       help=f"local stand-in for /opt/ml: SM_MODEL_DIR, SM_OUTPUT_DATA_DIR and the channels default "
                            f"under it (default ./{env.DEFAULT_DIR})")
    group.add_argument("--channel", action="append", default=[], type=env.parse_channel, metavar="NAME=DIR",
                       help="a data channel: sets SM_CHANNEL_NAME=DIR (repeatable)")


def launcher_parser() -> argparse.ArgumentParser:
    """torchrun's parser with our options added (its ``training_script`` is the script)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "modelparallel run"
    parser.description = HELP
    _add_sagemaker_options(parser)
    return parser


def rank_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelparallel.run", description=HELP)
    _add_sagemaker_options(parser)
    parser.add_argument("-m", "--module", action="store_true", help="the script is a module name")
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _our_env(args: argparse.Namespace) -> dict[str, str]:
    out = env.channel_env(args.channel)
    if args.sagemaker_dir is not None:
        out[env.DIR_ENV] = str(Path(args.sagemaker_dir).absolute())
    return out


def _exit_code(exc: SystemExit) -> int:
    """The status of the script's ``sys.exit(code)``. ``sys.exit("message")`` means "failed with
    this message" (Python prints it and exits 1): it is raised again, so the rank's record, and
    the launcher's report, carry the message rather than a bare status 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    raise SystemExit(str(code)) from None


def run_script(args: argparse.Namespace) -> int:
    """The rank part: environment, import hook, then the script as ``__main__``."""
    os.environ.update(_our_env(args))
    env.apply()
    env.cpu_cuda_calls()
    torch_calls.install()
    hook.install()
    script = args.training_script
    sys.argv = [script, *args.training_script_args]
    outcome.PROGRESS.stage = script  # what the launcher's report names as the failing stage

    def job() -> int:
        try:
            if args.module:
                runpy.run_module(script, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, str(Path(script).absolute().parent))
                runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            return _exit_code(exc)
        except ZeroDivisionError as exc:
            hint = env.device_count_hint(exc)
            if hint is None:
                raise
            raise RuntimeError(hint) from exc
        return 0

    return outcome.run_rank(job)


def _no_module(name: str) -> bool:
    """Whether the top-level package of ``-m name`` is nowhere a rank looks (the ranks put the
    current directory first on ``sys.path``). Nothing is imported: a top-level name has no parent
    package to import, and the script's own package may do anything on import."""
    top = name.partition(".")[0]
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(top) is None
    except (ImportError, ValueError):  # an odd name: the ranks say what is wrong with it
        return False
    finally:
        del sys.path[0]


def _nproc(value: str, determine) -> tuple[int | None, list[str]]:
    """(``--nproc-per-node`` as a number of ranks, or None; the problem with it). torchrun's
    ``determine`` also reads ``cpu``, ``gpu``, ``auto``; 0 or a word torchrun does not know would
    otherwise end in a traceback from inside torchrun's agent."""
    try:
        nproc = determine(value)
    except ValueError as exc:
        return None, [f"error: --nproc-per-node {value}: {exc} (a number of ranks >= 1, or cpu, gpu, auto)"]
    if nproc < 1:
        return None, [f"error: --nproc-per-node must be at least 1, got {value}"]
    return nproc, []


def _script_problems(args: argparse.Namespace) -> list[str]:
    """The script (or ``-m`` module) must be there: found now, not once per rank after launch."""
    script = Path(args.training_script)
    if not args.module and not script.is_file():
        return [f"{args.training_script}: {'is a directory, not a script' if script.is_dir() else 'no such script'}"]
    if args.module and _no_module(args.training_script):
        return [f"-m {args.training_script}: no such module"]
    return []


def launch_ranks(args: argparse.Namespace) -> int:
    """The launcher part: torchrun's agent over ``modelparallel.run`` on every rank. Every problem
    found before launch is printed, the ranks' count first (the launch's own option), then the
    script's."""
    from torch.distributed.run import determine_local_world_size

    from .. import devices

    nproc, problems = _nproc(args.nproc_per_node, determine_local_world_size)
    if args.no_python:  # a usage error, reported with the others (exit 2)
        problems.insert(0, "error: --no-python cannot be used: the ranks run Python (the script)")
    if nproc is not None:
        problems += [f"error: {p}" for p in devices.launch_problems(nproc, "lower --nproc-per-node")]
    problems += _script_problems(args)
    for problem in problems:
        print(f"modelparallel run: {problem}", file=sys.stderr, flush=True)
    if problems:
        return 2
    launch.warn_oversubscribed("run", nproc)
    rank_args = (["-m"] if args.module else []) + [args.training_script, *args.training_script_args]
    args.module, args.run_path = True, False
    args.training_script, args.training_script_args = "modelparallel.run", rank_args
    root = Path(args.sagemaker_dir or env.DEFAULT_DIR).absolute()
    status = status_dir.create("run")  # named for this launcher: swept by a later one if this one is killed
    extra = {**_our_env(args), env.DIR_ENV: str(root), outcome.STATUS_ENV: str(status)}
    if devices.requested() == "cpu":  # the script's own torch.cuda calls must not find the GPUs either
        extra["CUDA_VISIBLE_DEVICES"] = ""
    try:
        exc = launch.run_agent(args, nproc, extra)
        return 0 if exc is None else _report(exc, status, root / "output" / "failure.log")
    finally:
        shutil.rmtree(status, ignore_errors=True)


def _report(exc: BaseException, status: Path, log_path: Path) -> int:
    sig = outcome.stopping_signal(exc)
    ending = outcome.Ending.read(status, interrupted=sig == signal.SIGINT)
    if ending.interrupted or sig is not None:  # the ranks were stopped with the launcher
        what = "interrupted" if sig in (None, signal.SIGINT) else f"stopped by {sig.name}"
        print(f"\nmodelparallel run: {what}", file=sys.stderr, flush=True)
        return outcome.signal_exit(sig)
    errors = outcome.killed_ranks(exc, {r["rank"] for r in ending.records}) + ending.errors()
    if not errors:  # no rank said why (os._exit, a crash) or none ran: one block, not torchrun's report
        record = outcome.from_torchrun(exc)
        print("\n" + outcome.failure_block(record, None, 1, command="run"), file=sys.stderr, flush=True)
        return record.get("exit_code") or 1
    log = outcome.write_log(log_path, errors)
    if errors[0]["traceback"] and errors[0]["type"] != "SystemExit":  # sys.exit("message"): the message says it
        print("\n" + errors[0]["traceback"].rstrip(), file=sys.stderr)
    print(outcome.failure_block(errors[0], log, len(errors), command="run"), file=sys.stderr, flush=True)
    return errors[0].get("exit_code") or 1  # the script's own status when it exited with one


def main(argv: list[str] | None = None) -> int:
    """``modelparallel run`` / ``python -m modelparallel.run``: launch, or (under a launcher)
    run this rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    launch.die_with_launcher()
    if launch.under_launcher():
        return run_script(rank_parser().parse_args(argv))
    return launch_ranks(launcher_parser().parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """For ``modelparallel --help``: the command parses its own arguments (torchrun's)."""
    parser.add_argument("arguments", nargs=argparse.REMAINDER,
                        help="[torchrun options] [--sagemaker-dir DIR] [--channel NAME=DIR] script.py [args]")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return main(args.arguments)
