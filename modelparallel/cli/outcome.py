"""How a launched run ends, told once: each rank records its end in a status directory, the
launcher reads those records and prints one short block.

A rank that raises would otherwise print its traceback, and its peers (whose collectives then
fail) print theirs, and the launcher adds its own report: dozens of lines in which the cause is
hard to find. Instead, a rank started by our launcher writes its traceback to a file and a
one-line record (error type, message, time) to the status directory, and exits quietly. The
launcher picks the earliest error (the cause; later ones are peers losing their connection),
writes every traceback to one log file and prints the cause and that file's path.

Ctrl-C reaches every rank as SIGINT (from the terminal, or forwarded by the launcher): a rank
notes the step it was on and exits without saving anything, so the checkpoints on disk are
exactly the ones committed before; the launcher says where a rerun resumes from. A SIGTERM
(``kill``, a scheduler's preemption) ends the ranks at once, wherever they are (a rank blocked in
a collective could not run a handler); each rank's steps completed are kept current in the status
directory (``at_step``), so the launcher still says the step reached. A job that returns a non-zero
status (a script's ``sys.exit(3)``) is recorded too, with that status: otherwise its peers' lost
connections would be the only records, and the launcher would name one of them as the cause.
For the same reason a rank killed by a signal no one sends to stop a run (SIGKILL of the
out-of-memory killer, a crash's SIGSEGV), which can leave no record, is named before the records
of its peers (``killed_ranks``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NoReturn

STATUS_ENV = "MODELPARALLEL_CLI_STATUS"
"""The directory where ranks started by our launcher record how they ended."""

INTERRUPTED_EXIT = 130  # the shell's code for a process ended by SIGINT


def stopping_signal(exc: BaseException) -> signal.Signals | None:
    """The signal that stopped the launcher's agent (Ctrl-C's SIGINT, a ``kill``'s SIGTERM, a
    closed terminal's SIGHUP), or None when ``exc`` is no signal's."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return getattr(exc, "sigval", None)


def signal_exit(sig: signal.Signals | None) -> int:
    """The shell's status for a process ended by ``sig``, 128 + its number (130 for SIGINT, 143
    for SIGTERM): a job script or scheduler tells a preemption from a Ctrl-C by it. None (a rank
    recorded an interrupt the launcher did not see) is Ctrl-C's."""
    return INTERRUPTED_EXIT if sig is None else 128 + int(sig)


@dataclass
class Progress:
    """What a rank is doing, for the record written if it is interrupted or fails."""

    step: int | None = None  # steps completed; None before training starts
    interrupted: bool = False
    stage: str = "set-up"
    step_fd: int = -2  # the status directory's step file of this rank; -2 not yet opened, -1 none


PROGRESS = Progress()


def _on_sigint(signum, frame) -> None:
    """First SIGINT: remember it and unwind; later ones (the terminal's and the launcher's copy
    of the same Ctrl-C) are ignored so the unwinding is not interrupted in turn."""
    PROGRESS.interrupted = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def at_step(step: int) -> None:
    """``step`` steps completed on this rank: noted for a record, and under our launcher written
    in place to ``step{rank}`` in the status directory (one ``pwrite`` per step), which outlives
    a rank killed without a record."""
    PROGRESS.step = step
    if PROGRESS.step_fd == -2:
        status = os.environ.get(STATUS_ENV)
        rank = os.environ.get("RANK", "0")
        PROGRESS.step_fd = os.open(Path(status) / f"step{rank}", os.O_WRONLY | os.O_CREAT, 0o644) if status else -1
    if PROGRESS.step_fd >= 0:
        os.pwrite(PROGRESS.step_fd, b"%20d" % step, 0)


def _record(status_dir: Path, rank: int, record: dict) -> None:
    path = status_dir / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(path.with_suffix(".tmp"), path)


def run_rank(job: Callable[[], int]) -> int:
    """Run ``job`` on this rank. Under our launcher, its end is recorded (not printed) and the
    process exits at once: a failing rank's peers are stuck in collectives, and a normal
    interpreter exit would wait for them. Under any other launcher, ``job`` runs as is."""
    status = os.environ.get(STATUS_ENV)
    if not status:
        return job()
    rank = int(os.environ.get("RANK", "0"))
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        code = job()
    except BaseException as exc:  # noqa: BLE001 - every end is reported by the launcher
        interrupted = PROGRESS.interrupted or isinstance(exc, KeyboardInterrupt)
        _end(Path(status), rank, INTERRUPTED_EXIT if interrupted else 1, type(exc).__name__, str(exc).strip(),
             "".join(traceback.format_exception(exc)), interrupted)
    if code:
        _end(Path(status), rank, code, "SystemExit", f"exited with status {code}", "", False)
    return code


def _end(status: Path, rank: int, code: int, kind: str, message: str, trace: str, interrupted: bool) -> NoReturn:
    """Record this rank's end and exit with ``code`` at once (see ``run_rank``)."""
    record = {"rank": rank, "time": time.time(), "step": PROGRESS.step, "stage": PROGRESS.stage,
              "interrupted": interrupted, "type": kind, "message": message, "traceback": trace, "exit_code": code}
    _record(status, rank, record)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Ending:
    """What the launcher learned about a run that did not finish."""

    records: list[dict] = field(default_factory=list)
    interrupted: bool = False
    steps: list[int] = field(default_factory=list)  # each rank's steps completed (its step file)

    @classmethod
    def read(cls, status_dir: Path, interrupted: bool) -> "Ending":
        records = []
        for f in sorted(status_dir.glob("rank*.json")):
            try:
                records.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        records.sort(key=lambda r: r["time"])
        steps = []
        for f in status_dir.glob("step*"):
            try:
                steps.append(int(f.read_bytes()))
            except (OSError, ValueError):
                continue
        return cls(records, interrupted or any(r["interrupted"] for r in records), steps)

    def errors(self) -> list[dict]:
        return [r for r in self.records if not r["interrupted"]]

    def step(self) -> int | None:
        """Steps completed when the run stopped: the furthest any rank got."""
        steps = [r["step"] for r in self.records if r["step"] is not None] + self.steps
        return max(steps) if steps else None

    def exit_code(self) -> int:
        """The status of the rank that ended first (1 if it recorded none)."""
        errors = self.errors()
        return (errors[0].get("exit_code") or 1) if errors else 1


def killed_ranks(exc: BaseException, recorded: set[int]) -> list[dict]:
    """Records for the ranks torchrun's ``exc`` saw die by a signal without a record of their own,
    except SIGTERM and SIGINT (what a launcher sends to stop the other ranks once one failed):
    a rank the kernel killed (SIGKILL when out of memory) or that crashed outside Python. Such a
    death is the cause; its peers' records (a closed connection) follow from it."""
    failures = getattr(exc, "failures", None) or {}
    return [{"rank": rank, "time": f.timestamp, "step": None, "stage": "its run", "interrupted": False,
             "type": "ProcessExit", "exit_code": 1, "traceback": "",
             "message": f"killed by {f.signal_name()} without reporting an error (out of memory, killed, or "
                        "crashed outside Python); the other ranks' errors follow from it"}
            for rank, f in sorted(failures.items())
            if f.exitcode < 0 and -f.exitcode not in (signal.SIGTERM, signal.SIGINT) and rank not in recorded]


def from_torchrun(exc: BaseException) -> dict:
    """A record for a rank that died without writing one (killed, crashed in C, ``os._exit``, failed
    to start), or for a launch that failed before any rank ran (e.g. the machines never met): what
    a launcher reports instead of torchrun's own 20-line report, from torchrun's exception ``exc``."""
    first = getattr(exc, "get_first_failure", None)
    if first is None:
        return {"rank": "launcher", "step": None, "stage": "launch", "type": type(exc).__name__,
                "message": str(exc).strip() or repr(exc)}
    rank, failure = first()
    signame = failure.signal_name() if failure.exitcode < 0 else ""
    message = (f"exited with {signame}" if signame else f"exited with code {failure.exitcode}") + \
        " without reporting an error (killed, out of memory, or crashed outside Python); its output is above"
    return {"rank": rank, "step": None, "stage": "its run", "type": "ProcessExit", "message": message,
            "exit_code": failure.exitcode if failure.exitcode > 0 else 1}


def write_log(log_path: Path, records: list[dict]) -> Path:
    """Every recorded traceback, earliest first, in one file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as f:
        for r in records:
            when = time.strftime("%H:%M:%S", time.localtime(r["time"])) + f".{int(r['time'] * 1000) % 1000:03d}"
            f.write(f"=== rank {r['rank']} at {when} ({r['stage']}, step {r['step']}):\n{r['traceback']}\n")
    return log_path


def failure_block(first: dict, log_path: Path | None, n_failed: int, hint: str = "", command: str = "train") -> str:
    """The few lines printed for a failed run: who failed first, with what, and where the rest is."""
    message = first["message"]
    lines = message.splitlines()
    if len(lines) > 12:
        message = "\n".join(lines[:12] + [f"... ({len(lines) - 12} more lines in the log)"])
    where = f"rank {first['rank']}" + (f" at step {first['step']}" if first["step"] is not None else
                                       f" during {first['stage']}")
    out = [f"modelparallel {command} failed: {where}", f"  {first['type']}: {message}".replace("\n", "\n  ")]
    if n_failed > 1:
        out.append(f"  ({n_failed - 1} other rank(s) failed after it)")
    if hint:
        out.append(f"  {hint}")
    if log_path is not None:
        out.append(f"  full tracebacks: {log_path}")
    return "\n".join(out)
