"""Failure on one rank becomes an exception on every rank: phases that end in an agreement.

A checkpoint save or load is a sequence of phases. Each rank runs its local part of a phase,
catching any exception; then every rank joins one ``all_gather_object`` of (error, payload). If
any rank failed, every rank raises ``CheckpointError`` naming the phase, the failing ranks and
their messages. A rank that died outright (SIGKILL) breaks the collective for its peers, which
then raise at once (gloo notices the closed connection); a rank that hangs is bounded by the
process-group timeout, the last resort.

The local part of a phase must not start collectives that a failing rank could skip, or the
agreement would pair with the wrong collective. DCP's own save/load is safe inside a phase: it
propagates a failure on one rank to all ranks itself before returning.
"""

from __future__ import annotations

import builtins
import functools
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from ... import runtime
from .failure import CheckpointError  # re-exported: callers have always imported it from here


def _error_class(names: set[str]) -> type:
    """``CheckpointError``, mixed with the one built-in exception type all failing ranks raised."""
    name = next(iter(names)) if len(names) == 1 else None
    base = getattr(builtins, name, None) if name else None
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(CheckpointError, base):
        return CheckpointError
    return _typed_error(name, base)


@functools.cache
def _typed_error(name: str, base: type) -> type:
    """One class per built-in type, so ``type(e)`` is the same for the same failure."""
    return type(f"Checkpoint{name}", (CheckpointError, base), {"__str__": RuntimeError.__str__})


def object_group() -> dist.ProcessGroup | None:
    """The group for object collectives: the runtime's (``Runtime.object_group``), or the
    default group when the library's runtime was not started."""
    if not dist.is_initialized() or not runtime.is_initialized():
        return None
    return runtime.current().object_group()


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def agree(phase: str, error: BaseException | None, payload: Any = None, group=None) -> list[Any]:
    """Share each rank's outcome of ``phase``; raise on every rank if any rank failed.

    Returns:
        Every rank's ``payload``, indexed by global rank.

    Raises:
        CheckpointError: naming the phase and each failing rank's error (chained to this rank's
            own exception, if it had one); the error a rank reports first is one that started
            on that rank (DCP passes a failure on to every rank). If a peer died, naming it.
        KeyboardInterrupt: on a rank interrupted during the phase (even inside DCP, which wraps
            it), itself, after every rank learned of it.
    """
    root = cause(error) if error is not None else None
    mine = None if root is None else (type(root).__name__, _message(root))
    rank = dist.get_rank() if dist.is_initialized() else 0
    here = origin(error, rank) if error is not None else None
    outcomes = [(mine, payload, here)]
    if _world() > 1:
        outcomes = [None] * _world()
        try:
            dist.all_gather_object(outcomes, (mine, payload, here), group=group or object_group())
        except (RuntimeError, dist.DistBackendError) as lost:
            raise peer_lost(phase, lost) from (error or lost)
    failed = [(r, e) for r, (e, _, _) in enumerate(outcomes) if e is not None]
    if failed:
        started = [(r, e) for r, e in failed if outcomes[r][2] == r] or failed
        by_error: dict[tuple[str, str], list[int]] = {}
        for r, e in started:
            by_error.setdefault(e, []).append(r)
        lines = [f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {name}: {msg}"
                 for (name, msg), rs in by_error.items()]
        cls = _error_class({name for _, (name, _) in started})
        first_rank, (name, msg) = started[0]
        first_rank = outcomes[first_rank][2]  # where DCP says the error happened
        lead = msg.splitlines()[0] if msg.strip() else name
        agreed = cls(f"{lead} (rank {first_rank}, during checkpoint {phase})\n"
                     f"checkpoint {phase} failed on rank(s) {[r for r, _ in failed]}:\n  "
                     + "\n  ".join(lines))
        if isinstance(root, KeyboardInterrupt) and here == rank:  # Ctrl-C stays itself where it hit, once all know
            raise root.with_traceback(root.__traceback__) from agreed
        raise agreed from error
    return [p for _, p, _ in outcomes]


ROLL_CALL_S = 3.0
"""How long the survivors of a broken collective wait for each other before naming who is missing."""


def peer_lost(phase: str, lost: BaseException) -> CheckpointError:
    """The error for a collective broken by a peer that died (SIGKILL, crash) or hangs: the
    survivors answer a roll call through the job's store, and the ranks that do not answer
    within ``ROLL_CALL_S`` are named."""
    first = str(lost).strip().splitlines()[0] if str(lost).strip() else type(lost).__name__
    missing = roll_call(f"modelparallel/checkpoint/alive/{phase}")
    if missing is None:
        who = "a peer rank stopped answering (which one could not be told: the job's store is gone too)"
    else:
        who = f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} died or stopped answering"
    return CheckpointError(f"{who} (rank {dist.get_rank()}, during checkpoint {phase})\n"
                           f"the collective failed with: {first[:300]}")


def roll_call(key: str) -> list[int] | None:
    """Ranks that did not answer: each survivor counts itself in under ``key/{rank}`` (a count,
    so an earlier roll call of the same phase does not answer for a rank that died since), then
    waits for every rank to reach its own count. None if the store cannot be used."""
    import time

    from ...compat import default_store

    try:
        store, rank = default_store(), dist.get_rank()
        mine = store.add(f"{key}/{rank}", 1)
        deadline = time.monotonic() + ROLL_CALL_S
        while True:
            missing = [r for r in range(_world()) if r != rank and store.add(f"{key}/{r}", 0) < mine]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - any store failure: we cannot tell
        return None


def cause(error: BaseException) -> BaseException:
    """The exception that started it: DCP wraps each rank's error in a ``CheckpointException``
    whose text leads with ``CheckpointException ranks:...`` and a traceback; its first wrapped
    failure is what the user needs to read first."""
    while isinstance(error, CheckpointException) and error.failures:
        inner = next(iter(error.failures.values()))
        error = inner[0] if isinstance(inner, tuple) else inner
    # torch.save's zip writer reports a failed write of its file object as "unexpected pos ...";
    # the OSError that caused it (disk full, EIO) is its context
    if isinstance(error, RuntimeError) and "unexpected pos" in str(error) and isinstance(error.__context__, OSError):
        return error.__context__
    return error


def origin(error: BaseException, rank: int) -> int:
    """The rank an error started on: DCP's exception records it; others started here."""
    if isinstance(error, CheckpointException) and error.failures:
        return int(next(iter(error.failures)))
    return rank


def _message(error: BaseException) -> str:
    """The error's text, naming the file for an OS error that carries one (KeyError's str()
    adds quotes around its argument; they are dropped)."""
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    if isinstance(error, OSError) and error.strerror and error.filename and str(error.filename) not in str(error):
        return f"{error} ({error.filename})"
    return str(error)


def run_phase(phase: str, fn: Callable[[], Any], group=None) -> list[Any]:
    """Run ``fn()`` on this rank, then ``agree`` (over ``group``, default ``object_group()``):
    every rank returns all ranks' results, or every rank raises ``CheckpointError`` if ``fn``
    raised anywhere."""
    try:
        result, error = fn(), None
    except (Exception, CheckpointException, KeyboardInterrupt) as e:  # noqa: BLE001 - agree() tells every rank
        result, error = None, e
    return agree(phase, error, result, group)


def single_error(phase: str, errors: list[str]) -> None:
    """Raise one error listing every problem found (e.g. by all ranks' checksum checks), the
    first one on the first line (it names the file and what is wrong with it)."""
    if errors:
        more = f" and {len(errors) - 1} more" if len(errors) > 1 else ""
        raise CheckpointError(f"{errors[0].splitlines()[0]} (checkpoint {phase}{more})\n  - " + "\n  - ".join(errors))


def same_on_every_rank(call: str, **args) -> None:
    """Raise ``ValueError`` on every rank if ranks passed different ``args`` (a collective).
    Paths agree when every rank gave the same text (one shared directory may resolve to
    different mount points on different machines) or when they resolve to one directory (named
    two ways on one machine). Rank 0's path and tag name the directory every rank writes into or
    reads from, so a rank given another tag otherwise "saved" it silently into rank 0's, and a
    resume read each rank's shard from a different checkpoint."""
    every = run_phase(f"{call} (arguments)", lambda: {
        **args, **({"path": os.fspath(args["path"]), "resolved path": os.path.realpath(args["path"])}
                   if "path" in args else {})})
    differ = [k for k in args if len({repr(e[k]) for e in every}) > 1
              and not (k == "path" and len({e["resolved path"] for e in every}) == 1)]
    if differ:
        raise ValueError(f"{call}: every rank must pass the same {', '.join(differ)}; got "
                         + "; ".join(f"{k}: " + ", ".join(f"rank {r} {e[k]!r}" for r, e in enumerate(every))
                                     for k in differ))
