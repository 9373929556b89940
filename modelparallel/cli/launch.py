"""Start the ranks of a subcommand with torchrun's machinery, unless a launcher already started us.

A user who types ``modelparallel train --tp 2`` should not need to know torchrun; a user who runs
it under their own ``torchrun`` (or a cluster's launcher) must not get ranks that launch ranks.
The launcher's environment (RANK, WORLD_SIZE) tells the two apart.

The launch runs torchrun's own code (``torch.distributed.run``) in this process rather than a
``torchrun`` child: this process is then the agent, so it sees a failure or a Ctrl-C as an
exception and can report it in a few lines (``outcome``) instead of torchrun's report.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

from .. import cpus

START_TIME_ENV = "MODELPARALLEL_CLI_START"
"""Wall-clock start of the command, passed to the ranks so reported times include the launch."""

LAUNCHER_PID_ENV = "MODELPARALLEL_CLI_LAUNCHER"
"""The pid of our launcher, the ranks' parent: a rank whose parent is another has lost it."""

_PR_SET_PDEATHSIG = 1


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
    """When the user's command started (set by the launching process or a wrapper script that
    ``exec``s us after other work), else this process's start."""
    try:
        return float(os.environ[START_TIME_ENV])
    except (KeyError, ValueError):
        return _process_start()


def threads_per_rank(nproc: int) -> int:
    """Cores divided among the ranks, at least one: more threads than cores makes every rank's
    collectives wait for descheduled threads, which costs far more than it gains."""
    return max(1, cpus.usable() // nproc)


def oversubscription(nproc: int) -> str | None:
    """A warning when a CPU run starts more ranks on this machine than it has cores, else None.

    Not a refusal: it runs, and a test of a layout may want more ranks than a laptop's cores. But
    every collective then waits for ranks the scheduler has put aside, so steps are many times
    slower, and nothing else says why. On GPUs each rank has its own GPU (``devices`` refuses more
    ranks than GPUs), so nothing is said there."""
    from .. import devices

    try:
        if devices.device_type() != "cpu":
            return None
    except (ValueError, RuntimeError):  # a bad MODELPARALLEL_DEVICE: the checks report it
        return None
    cores = cpus.usable()
    if nproc <= cores:
        return None
    threads = rank_env(nproc)["OMP_NUM_THREADS"]
    each = "one thread" if threads == "1" else f"{threads} threads (OMP_NUM_THREADS)"
    return (f"warning: oversubscribed: {nproc} ranks on {cores} core{'s' * (cores > 1)}, expect slow steps; "
            f"each rank gets {each}")


def warn_oversubscribed(command: str, nproc: int) -> None:
    """Print ``oversubscription``'s warning, if any, as one line of ``modelparallel COMMAND``."""
    warning = oversubscription(nproc)
    if warning:
        print(f"modelparallel {command}: {warning}", file=sys.stderr, flush=True)


def rank_env(nproc: int) -> dict[str, str]:
    """What the ranks need in their environment beyond the user's: a thread count that fits the
    machine (unless the user chose one) and the start time."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_rank(nproc))),
            "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
            START_TIME_ENV: os.environ.get(START_TIME_ENV, repr(start_time())),
            LAUNCHER_PID_ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """In a rank our launcher started: be killed when the launcher dies, however it dies.

    torchrun's agent starts every rank in a session of its own, so a SIGKILL of the launcher (or
    of its process group) reaches no rank, and orphaned ranks would go on training and saving
    into the run's directory. Linux's ``PR_SET_PDEATHSIG`` has the kernel send SIGKILL to this
    process when its parent exits; the parent may already have died before the call (this runs
    after the interpreter and torch started), so the parent pid is then checked against the
    launcher's. Elsewhere (no ``prctl``) nothing is done; not started by our launcher, nothing
    is done either (another launcher decides what its ranks' lives depend on)."""
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if not expected or not under_launcher():
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != int(expected):  # the launcher died before the call: its signal is lost
        os._exit(1)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Nodes:
    """Where the ranks run: ``nproc`` per machine on ``nnodes`` machines. With several machines,
    every one runs the same command with its own ``node_rank``; ``rdzv_endpoint`` (host:port of
    the node-rank-0 machine) is where they meet."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None


def torchrun_args(nodes: Nodes, argv: list[str]) -> list[str]:
    """torchrun's arguments for ``python -m modelparallel.cli <argv>`` on this machine.

    The ``--`` matters: torchrun's argparse scans every later argument for its own option
    prefixes, so a bare ``--nproc 4`` would fail as ambiguous with ``--nproc-per-node``. ``main``
    drops the ``--`` again if torchrun passes it through.
    """
    if nodes.nnodes == 1 and not nodes.rdzv_endpoint:
        where = ["--standalone"]
    else:
        endpoint = nodes.rdzv_endpoint or "localhost:29500"
        where = ["--nnodes", str(nodes.nnodes), "--node-rank", str(nodes.node_rank), "--rdzv-endpoint", endpoint]
        host = endpoint.rpartition(":")[0].strip("[]")
        if host in LOOPBACK:  # "machines" on one host: keep the ranks' meeting point on loopback too
            where += ["--local-addr", host]
    return ["--nproc-per-node", str(nodes.nproc), *where, "-m", "modelparallel.cli", "--", *argv]


def torchrun(nodes: Nodes, argv: list[str], extra_env: dict[str, str]) -> BaseException | None:
    """Run the ranks of this machine to the end; returns None on success, else the exception
    torchrun's agent raised (``ChildFailedError``, ``SignalException`` on Ctrl-C / SIGTERM, a
    rendezvous error...). The agent's own log lines are silenced: the caller reports."""
    from torch.distributed.run import parse_args

    return run_agent(parse_args(torchrun_args(nodes, argv)), nodes.nproc, extra_env)


_AGENT_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))
"""The signals torchrun's agent takes over while its ranks run. Its handler raises an exception
that is no ``KeyboardInterrupt``, so left in place after the ranks ended, a second Ctrl-C while
the launcher reports would end it in a traceback with status 1."""


def run_agent(args, nproc: int, extra_env: dict[str, str]) -> BaseException | None:
    """``torchrun`` with its parsed arguments ``args`` (``nproc`` ranks on this machine), as
    ``torchrun`` above describes; ``modelparallel run`` passes the user's torchrun options."""
    from torch.distributed.run import run

    added = {**rank_env(nproc), **extra_env}
    before = {k: os.environ.get(k) for k in added}
    handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
    os.environ.update(added)  # the agent gives the ranks this process's environment
    for name in list(logging.root.manager.loggerDict):  # each sets its own level, so set each
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - reported by the caller
        return exc
    finally:  # none of it outlives the run: a later launch or child of this process must not see it
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    return None
