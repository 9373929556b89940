"""Checkpoints that do not stop training: stage to host memory, write in the background.

``smp.save_checkpoint(..., async_save=True)`` copies this rank's state into host staging
buffers (``stager.Stager``: the tensors only an optimizer step changes may be copied by the
background thread, the optimizer's next step waiting for that copy); a background thread
(``AsyncSaver``) then runs the save's write, checksum and commit phases exactly as a synchronous
save does, so every guarantee holds: the checkpoint becomes ``newest`` only when every rank's part
is durable, a crash at any moment leaves the previous newest intact, an error on any rank is an
error on every rank.

The background phases are collectives. They run on their own gloo process group
(``meshes.background_group``: never interleaved with the training's collectives on the default
group; with the default group's timeout), made by ``init`` at start-up and kept in the runtime's
``meshes.MeshCache``: every later job of the process over the same world reuses it (a gloo group
keeps its threads and sockets until the process ends). A saver without a cache makes its own at
its first save. At most one save is in flight per job: the next save (synchronous or not),
``wait()`` and the interpreter's exit wait for it first, and raise its error, if it failed, on
every rank.

``AsyncSaver`` and ``Stager`` know nothing of partial checkpoints: they run any callable on a
staged state, so the other checkpoint surfaces (full checkpoints, ``distributed.checkpoint``)
reuse them.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...meshes import MeshCache, background_group
from .stager import OUR_WORDING, Stager

logger = logging.getLogger("modelparallel")


@dataclass
class Job:
    """One background save: its thread, its error, and the event that says staging is done."""

    tag: str
    staged: threading.Event = field(default_factory=threading.Event)
    future: Future | None = None
    error: BaseException | None = None
    hooks: list = field(default_factory=list)
    result: Any = None
    held_s: float = 0.0
    """Seconds the steps held by this job waited for its staging (training time blocked)."""
    events: list = field(default_factory=list)
    """(device, event) after the call's side-stream copies: a step's stream waits for them."""

    def hold(self, *_) -> None:
        """A step pre-hook: wait until staging is done (side-stream copies: the current stream
        waits for them on the device, the host goes on)."""
        for device, event in self.events:
            torch.cuda.current_stream(device).wait_event(event)
        if not self.staged.is_set():
            start = time.perf_counter()
            self.staged.wait()
            self.held_s += time.perf_counter() - start

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def join(self) -> None:
        """Wait for the job, and drop the step hooks (safe here: no step is running)."""
        if self.future is not None:
            wait((self.future,))
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()


class AsyncSaver:
    """A job's background checkpoint writer: one save in flight at a time, its error kept and
    raised by ``wait`` on every rank.

    Args:
        cache: where the background process group is kept (the runtime's ``mesh_cache``), so
            that a saver of each job shares one group; without it the saver makes its own.
    """

    def __init__(self, cache: MeshCache | None = None, wording: tuple[str, str] = OUR_WORDING):
        self.stager = Stager(wording)
        self.cache = cache
        self.group: dist.ProcessGroup | None = None
        self.job: Job | None = None
        self._registered = False
        self._worker: ThreadPoolExecutor | None = None
        """The thread the jobs run in, one after another: started by the first save and kept, so a
        later save's call does not wait for a new thread to start (a scheduler round trip, a few
        milliseconds on a busy machine)."""

    @property
    def tag(self) -> str | None:
        return self.job.tag if self.job is not None else None

    def process_group(self) -> dist.ProcessGroup | None:
        """The background group (a collective the first time the cache has none: call it on
        every rank)."""
        if self.group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = background_group(self.cache)
        return self.group

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.done()

    def submit(self, tag: str, fn: Callable[[], Any], hold: tuple = (), at_exit: bool = True,
               hold_every_optimizer: bool = False) -> Job:
        """Run ``fn`` in the background, after the save in flight (if any) finished (its error
        stays with its ``Job``). ``hold``: optimizers whose ``step`` waits until ``staging_done``
        is called from ``fn`` (or ``fn`` ends); ``hold_every_optimizer``: every optimizer of the
        process waits (a save handed state dicts does not know which optimizers they came from).
        ``at_exit``: the interpreter's exit waits for it and logs its error."""
        if self.job is not None:
            self.job.join()
        job = self.job = Job(tag, events=self.stager.stream_events())
        job.hooks = [opt.register_step_pre_hook(job.hold) for opt in hold]
        if hold_every_optimizer:
            job.hooks.append(register_optimizer_step_pre_hook(job.hold))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="modelparallel-save")
        job.future = self._worker.submit(self._run, job, fn, self.stager.pin_later)
        if at_exit and not self._registered:
            atexit.register(_finish_at_exit, weakref.ref(self))
            self._registered = True
        return job

    def stage_deferred(self) -> None:
        """In the background thread: fill the deferred buffers, then release the steps held."""
        try:
            self.stager.copy_deferred(live=True)
        except BaseException:
            self.stager.abandon()  # the save failed: its snapshots are not moved
            raise
        finally:
            if self.job is not None:
                self.job.staged.set()
            self.stager.settle()
        self.stager.copy_deferred(live=False)

    def wait_staged(self) -> None:
        """Wait until the save in flight no longer reads the live tensors (its background copy
        is done); its errors are left for ``wait``. Not a collective."""
        if self.job is not None:
            self.job.hold()

    @staticmethod
    def _run(job: Job, fn: Callable[[], Any], then: Callable[[], None]) -> None:
        try:
            job.result = fn()
            then()
        except BaseException as e:  # noqa: BLE001 - raised by wait() on this rank
            job.error = e
        finally:
            job.staged.set()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error (every rank's background save raises the
        same ``CheckpointError``, so every rank raises it here)."""
        job = self.job
        if job is None:
            return
        job.join()
        error, job.error = job.error, None
        if error is not None:
            raise error


def _finish_at_exit(ref) -> None:
    """At interpreter exit: wait for the save in flight, or say which checkpoint is not
    committed."""
    saver = ref()
    if saver is None or saver.job is None or saver.job.future is None:
        return
    tag = saver.tag
    try:
        saver.wait()
    except BaseException as e:  # noqa: BLE001 - nothing left to raise to
        logger.error("asynchronous checkpoint %r was not committed: %s", tag, str(e).splitlines()[0])
    finally:
        saver.stager.pinner.stop()  # the save's end may start it: no pinning left while the interpreter ends
