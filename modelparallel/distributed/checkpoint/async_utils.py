"""``AsyncCallsQueue``: the asynchronous checkpoint saves of a job, finalized in order
(SageMaker v2's ``torch.sagemaker.distributed.checkpoint.async_utils``).

``async_save(..., queue=q)`` returns once the save is planned and its tensors are copied to host
memory (or, those only an optimizer step changes, registered for a copy the writer thread makes
first while every optimizer's next step waits for it); the queue's ``AsyncSaver`` (the
checkpoint package's background writer) writes the files in its thread, one save after another,
into host buffers its ``Stager`` reuses. A save is *finalized* by
``q.maybe_finalize_async_calls(...)``, a collective over the group that saved it: every rank's
files are written, then the coordinator writes the checkpoint's ``.metadata`` and commits it
(until then ``checkpoint_id`` holds what it held before). ``blocking=True`` waits for every pending save;
``blocking=False`` finalizes, oldest first, only the saves every rank of their group has finished
writing (the ranks agree, so they all finalize the same ones). A write that failed on any rank
raises on every rank at that call. A queue whose saves are never finalized logs a warning at
exit naming the checkpoints that were never written.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections import deque

import torch
import torch.distributed as dist

from ... import devices
from ...checkpoint.background.async_save import AsyncSaver
from . import saving

logger = logging.getLogger("modelparallel")

_LIVE: weakref.WeakSet = weakref.WeakSet()

V2_WORDING = ("async_save", "This save fails (its directory keeps what it held before). Change tensors "
              "only in an optimizer's step (which waits for staging), call maybe_finalize_async_calls(blocking=True) "
              "first, or use AsyncCallsQueue(background_staging=False)")


class AsyncCallsQueue:
    """Pending asynchronous checkpoint saves, oldest first, and their host staging buffers."""

    def __init__(self, background_staging: bool = True):
        """``background_staging`` (ours; SageMaker's queue takes no argument): the tensors only
        an optimizer step changes are copied to host memory by the writer thread, and every
        optimizer's next ``step`` waits for that copy; ``False``: ``async_save`` copies every
        tensor before returning."""
        self.staging = "background" if background_staging else "call"
        self._pending: deque[tuple[int, saving.PendingSave]] = deque()
        self._next_index = 0
        self.saver = AsyncSaver(wording=V2_WORDING)
        """The background writer; its ``stager`` keeps the host buffers, by DCP write item."""
        self.plans = saving.PlanCache()
        _LIVE.add(self)

    @property
    def staging_bytes(self) -> int:
        """Host memory this queue holds for staging (kept and reused between saves)."""
        return self.saver.stager.nbytes

    def schedule(self, state_dict, writer, planner, group: saving.Group, extra_files=None) -> int:
        """Plan and stage a save (collectives over ``group``) and queue its writing; returns its
        index. A save still writing from an earlier call is waited for first (its buffers are
        about to be reused; its errors are raised when it is finalized)."""
        if self.saver.job is not None:
            self.saver.job.join()
        busy = {path: False for queue in list(_LIVE) if queue is not self for path in queue.pending_paths}
        busy.update((path, True) for path in self.pending_paths)
        pending = saving.start(state_dict, writer, planner, group, self.saver, self.plans, self.staging, busy=busy)
        pending.extra_files.update(extra_files or {})
        index = self._next_index
        self._next_index += 1
        self._pending.append((index, pending))
        return index

    def _all_done(self, pending: saving.PendingSave) -> bool:
        """Whether every rank of the save's group finished writing (a collective)."""
        done = torch.tensor([1 if pending.job.done() else 0], dtype=torch.int32,
                            device=devices.for_group(pending.group.pg))
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=pending.group.pg)
        return bool(done.item())

    def maybe_finalize_async_calls(self, blocking: bool = True, process_group: dist.ProcessGroup | None = None,
                                   skip_sync: bool = False) -> list[int]:
        """Finalize pending saves, oldest first; returns the indices finalized.

        Args:
            blocking: wait for every pending save; else finalize only those every rank of their
                group has finished writing, stopping at the first that is not.
            process_group: the group the saves were made with (each save is finalized over
                its own group; accepted for SageMaker's call form).
            skip_sync: accepted for SageMaker's call form; the ranks always agree, since the
                metadata must list every rank's files.

        Raises:
            CheckpointSaveError: on every rank, when a save's writing failed on any rank.
        """
        del process_group, skip_sync
        finalized = []
        while self._pending:
            index, pending = self._pending[0]
            if not blocking and not self._all_done(pending):
                break
            self._pending.popleft()
            saving.finish(pending)
            finalized.append(index)
        return finalized

    @property
    def pending_paths(self) -> list[str]:
        return [p.path for _, p in self._pending]

    def close(self) -> None:
        """Wait for the write in flight (its error stays for finalizing)."""
        if self.saver.job is not None:
            self.saver.job.join()


def wait_for_staging() -> None:
    """Wait until no save of any queue still copies from the live tensors (before a load
    overwrites them). Not a collective."""
    for queue in list(_LIVE):
        queue.saver.wait_staged()


@atexit.register
def _warn_unfinalized() -> None:
    for queue in list(_LIVE):
        if queue.pending_paths:
            logger.warning("modelparallel: asynchronous checkpoint saves never finalized (call "
                           "maybe_finalize_async_calls(blocking=True) before exiting); these directories keep "
                           "what they held before (the saves were never committed): %s", ", ".join(queue.pending_paths))
