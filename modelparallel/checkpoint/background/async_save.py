"""Checkpoints that do not stop training: stage to host memory, write in the background.

``smp.save_checkpoint(..., async_save=True)`` copies this rank's state into host staging
buffers (``Stager``: one buffer per tensor, reused by the next save when shapes and dtypes
match, pinned for tensors on a GPU); a background thread (``AsyncSaver``) then runs the save's
write, checksum and commit phases exactly as a synchronous save does, so every guarantee holds:
the checkpoint becomes ``newest`` only when every rank's part is durable, a crash at any moment
leaves the previous newest intact, an error on any rank is an error on every rank.

Staging itself can run in the background too (``defer``): the tensors only an optimizer step
changes (parameters, optimizer slots, fp32 masters) are copied by the background thread before
it writes, while the call copies at once what a forward can change (buffers, the loss scaler,
step counters, anything else). The call registers a step pre-hook on the optimizers the save
covers that waits until staging is done, so the step after a save cannot change a tensor not
yet copied. Anything else that changes a deferred tensor in place, by any means (``p.data.mul_()``,
a numpy view, another thread), is caught on the memory itself: the call takes the CRC32 of each
deferred tensor's bytes (a read at memory speed, about half the cost of copying them), and the
background thread compares it with the CRC32 of its copy; a tensor whose copy differs fails that
save on every rank, naming it, so a checkpoint never holds values other than the call's. The
version counters of the tensor and its aliases (FSDP's original parameters over a flat one) are
compared too, which also refuses a change through an alias that missed the saved memory. A
deferred tensor on a GPU is instead copied by the call on the tensor's stream, without waiting:
the stream orders the copy before any later change there, and the background thread waits for it.

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
import copy
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...meshes import MeshCache, background_group
from ...tp.layout import from_local_like
from .deferred import Deferred, Early, fingerprint

logger = logging.getLogger("modelparallel")


class StagedTensorChanged(RuntimeError):
    """A tensor staged in the background was changed in place before its copy was complete."""


OUR_WORDING = ("save_checkpoint(async_save=True)",
               "This save is abandoned (the previous newest checkpoint is intact). Change parameters only in "
               "the optimizer's step (which waits for staging), call smp.wait_for_checkpoints() first, or save "
               "with async_staging=False")


class Stager:
    """Host copies of a nested state (dicts, lists, tensors, DTensors, plain values), in buffers
    kept between saves: the same tensors at the same shapes are copied into the same memory."""

    def __init__(self, wording: tuple[str, str] = OUR_WORDING):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.deferred: list[Deferred] = []
        self.before_copy: Callable[[], None] | None = None
        """Called by ``copy_deferred`` before its first copy (tests pause staging with it)."""
        self.copied_bytes = self.deferred_bytes = 0
        """Bytes the last ``stage`` copied in the call / left to ``copy_deferred``."""
        self.wrappers: dict[tuple, tuple] = {}
        """The DTensors made around buffers by the last save, by path (with their buffer and layout)."""
        self.serialized: dict = {}
        """Serialized plain values of the last save, by key, for a caller that reuses them when
        the value is exactly the same (``distributed.checkpoint.staging``)."""
        self.wording = wording
        """(the call, what to do) for the message of a tensor changed before its copy."""
        self._early: Early | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory held on this rank."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def buffer(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        """The buffer kept under ``key`` for a tensor like ``t`` (a new one if none fits)."""
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self.buffers[key] = buf
        return buf

    def fingerprint_early(self, tensors: list[torch.Tensor] | None) -> None:
        """Start the CRC32s of ``tensors`` (those ``defer`` will get) in a thread now, so that
        the call's other work (state dicts, collectives) overlaps their reading; the save's
        call must not return before ``defer`` took them. ``None``: drop what is left. Without a
        core to spare for them (``Early.pays``) nothing starts: ``defer`` reads them itself."""
        self._early = Early(tensors) if tensors and Early.pays() else None

    def _crc(self, local: torch.Tensor) -> int:
        early = self._early.take(local) if self._early is not None else None
        return early if early is not None else fingerprint(local)

    def defer(self, name: str, source: torch.Tensor, local: torch.Tensor, buf: torch.Tensor,
              aliases: tuple = ()) -> None:
        """Leave the copy of ``local`` (``source``'s local tensor) into ``buf`` to
        ``copy_deferred``, recording the CRC32 of its bytes now, and the version counters of
        ``source``, ``local`` and ``aliases`` (e.g. FSDP's original parameters over a flat one).
        A GPU tensor is copied now on its stream without waiting; a non-contiguous one now."""
        watched = (source, local, *aliases)
        if local.device.type == "cuda":
            buf.copy_(local.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(local.device))
            self.deferred.append(Deferred(name, buf, local, None, event, watched))
        elif not local.is_contiguous():
            self.copy_now(local, buf)
            return
        else:
            self.deferred.append(Deferred(name, buf, local, self._crc(local), None, watched))
        self.deferred_bytes += buf.numel() * buf.element_size()

    def copy_now(self, t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.copy_(t.detach())
        self.copied_bytes += buf.numel() * buf.element_size()
        return buf

    def _copy(self, path: tuple, t: torch.Tensor, source: torch.Tensor, defer) -> torch.Tensor:
        buf = self.buffer(path, t)
        if defer is not None and defer(t):
            self.defer(".".join(map(str, path)), source, t, buf)
            return buf
        return self.copy_now(t, buf)

    def stage(self, state: Any, defer: Callable[[torch.Tensor], bool] | None = None) -> Any:
        """A copy of ``state`` whose tensors live in this stager's buffers (DTensors keep their
        mesh, placements and global shape around a host copy of their shard). Tensors whose
        local part ``defer`` accepts are only recorded: ``copy_deferred`` fills them. Without
        autograd: a DTensor's ``to_local()`` is then its local tensor, not an autograd view."""
        self.copied_bytes = self.deferred_bytes = 0
        with torch.no_grad():
            return self._stage(state, defer, ())

    def _stage(self, state: Any, defer, path: tuple) -> Any:
        if isinstance(state, DTensor):
            return self._wrapped(path, self._copy(path, state.to_local(), state, defer), state)
        if isinstance(state, torch.Tensor):
            return self._copy(path, state, state, defer)
        if isinstance(state, dict):
            out = copy.copy(state)  # keeps the type (OrderedDict, defaultdict)
            out.update((k, self._stage(v, defer, (*path, k))) for k, v in state.items())
            return out
        if isinstance(state, (list, tuple)):
            return type(state)(self._stage(v, defer, (*path, i)) for i, v in enumerate(state))
        return copy.deepcopy(state)

    def _wrapped(self, path: tuple, buf: torch.Tensor, like: DTensor) -> DTensor:
        """The DTensor over ``buf`` laid out like ``like``: the one made for the last save when
        the buffer and the layout are the same (making a DTensor is most of staging's time per
        tensor, besides reading it)."""
        layout = (like.device_mesh, like.placements, like.shape, like.stride())
        last = self.wrappers.get(path)
        if last is not None and last[0] is buf and last[1] == layout:
            return last[2]
        out = from_local_like(buf, like)
        self.wrappers[path] = (buf, layout, out)
        return out

    def copy_deferred(self) -> None:
        """Fill the deferred buffers; raise ``StagedTensorChanged`` naming every tensor whose copy
        does not hold the bytes it had at ``stage`` (changed in place by any means since, or
        during the copy) or whose version counter (or an alias's) moved."""
        pending, self.deferred = self.deferred, []
        if self.before_copy is not None and pending:
            self.before_copy()
        with torch.no_grad():
            changed = [d.name for d in pending if not d.copy()]
        if changed:
            raise StagedTensorChanged(
                f"{len(changed)} tensor(s) changed in place after {self.wording[0]} returned and before they were "
                f"staged: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}. {self.wording[1]}")


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

    def hold(self, *_) -> None:
        """A step pre-hook: wait until staging is done."""
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
        job = self.job = Job(tag)
        job.hooks = [opt.register_step_pre_hook(job.hold) for opt in hold]
        if hold_every_optimizer:
            job.hooks.append(register_optimizer_step_pre_hook(job.hold))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="modelparallel-save")
        job.future = self._worker.submit(self._run, job, fn)
        if at_exit and not self._registered:
            atexit.register(_finish_at_exit, weakref.ref(self))
            self._registered = True
        return job

    def stage_deferred(self) -> None:
        """In the background thread: fill the deferred buffers, then release the steps held."""
        try:
            self.stager.copy_deferred()
        finally:
            if self.job is not None:
                self.job.staged.set()

    def wait_staged(self) -> None:
        """Wait until the save in flight no longer reads the live tensors (its background copy
        is done); its errors are left for ``wait``. Not a collective."""
        if self.job is not None:
            self.job.hold()

    @staticmethod
    def _run(job: Job, fn: Callable[[], Any]) -> None:
        try:
            job.result = fn()
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
