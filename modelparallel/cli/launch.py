"""Start N ranks of a subcommand with torchrun, unless a launcher already started this process.

A user who types ``modelparallel train --tp 2`` should not need to know torchrun; a user who runs
it under their own ``torchrun`` (or a cluster's launcher) must not get ranks that launch ranks.
The launcher's environment (RANK, WORLD_SIZE) tells the two apart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

START_TIME_ENV = "MODELPARALLEL_CLI_START"
"""Wall-clock start of the command, passed to the ranks so reported times include the launch."""


def under_launcher() -> bool:
    """True when torchrun (or a compatible launcher) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _process_start() -> float:
    """This process's start on the wall clock (Linux /proc), else now: importing torch and
    transformers takes seconds, and a run's reported time should include them."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def start_time() -> float:
    """When the user's command started (the launching process's start), else this process's."""
    try:
        return float(os.environ[START_TIME_ENV])
    except (KeyError, ValueError):
        return _process_start()


def threads_per_rank(nproc: int) -> int:
    """Cores divided among the ranks, at least one: more threads than cores makes every rank's
    collectives wait for descheduled threads, which costs far more than it gains."""
    return max(1, (os.cpu_count() or 1) // nproc)


def rank_env(nproc: int) -> dict[str, str]:
    """The environment of each rank: the user's, plus a thread count that fits the machine
    (unless the user chose one) and the start time."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault(START_TIME_ENV, repr(start_time()))
    return env


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """``python -m torch.distributed.run ... -m modelparallel.cli -- <argv>`` for ``nproc`` local ranks.

    The ``--`` matters: torchrun's argparse scans every later argument for its own option
    prefixes, so a bare ``--nproc 4`` would fail as ambiguous with ``--nproc-per-node``. ``main``
    drops the ``--`` again if torchrun passes it through.
    """
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
            "-m", "modelparallel.cli", "--", *argv]


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run the command again as ``nproc`` ranks and return torchrun's exit code.

    Ctrl-C reaches torchrun too (same process group), which stops the ranks; we then only wait.
    """
    proc = subprocess.Popen(torchrun_command(nproc, argv), env=rank_env(nproc))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()
