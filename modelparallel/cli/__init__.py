"""The ``modelparallel`` command: one entry point, one module per subcommand.

A subcommand module provides ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args, parser) -> exit code``; adding one (e.g. ``convert``) is one line in ``COMMANDS``.
Modules are imported only to build the parser and keep torch/transformers imports inside
``run``, so ``modelparallel --help`` stays quick; the launcher of a preset run imports torch only
(to count GPUs and run torchrun's agent), never transformers or the engine: it pays that before
every launch, and the ranks pay it again (tests/cli/test_cli_imports.py holds both).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path


def user_path(text: str) -> Path:
    """A path argument as the user meant it: ``~`` expanded. A shell expands it only at the
    start of a word, so ``--out=~/runs`` arrives with its ``~``, and a directory named ``~`` made
    in the current one is never what was meant."""
    return Path(os.path.expanduser(text))


COMMANDS: dict[str, str] = {
    "train": "modelparallel.cli.train",
    "convert": "modelparallel.cli.convert",
    "inspect": "modelparallel.cli.inspect",
    "plan": "modelparallel.cli.plan",
    "run": "modelparallel.sagemaker.launch",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of ``COMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="modelparallel",
        description="Tensor-parallel training and tools for Hugging Face models on plain PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand."""
    from .launch import die_with_launcher

    die_with_launcher()  # first: a rank must not outlive the launcher that started it
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # the separator our own launcher puts before the arguments
        argv = argv[1:]
    try:  # from the first import on: a Ctrl-C while the parser's modules load is a Ctrl-C too
        if argv[:1] == ["run"]:  # torchrun's options and the script's own: the command parses them
            from ..sagemaker.launch import main as run_main

            return run_main(argv[1:])
        args = build_parser().parse_args(argv)
        args.argv = argv  # kept so a launcher can start the same command on every rank
        return args._run(args, args._parser)
    except KeyboardInterrupt:  # before any rank started, or in a rank before its job began
        from .outcome import STATUS_ENV

        if not os.environ.get(STATUS_ENV):  # our launcher's ranks leave the one report to it
            print(f"\n{' '.join(['modelparallel', *argv[:1]])}: interrupted", file=sys.stderr)
        return 130
