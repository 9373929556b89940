"""Checkpoints that do not stop training: stage to host memory, write in the background.

``smp.save_checkpoint(..., async_save=True)`` returns once this rank's state is copied into
host staging buffers (``Stager``: one buffer per tensor, reused by the next save when shapes and
dtypes match, pinned when a GPU is present); a background thread (``AsyncSaver``) then runs the
save's write, checksum and commit phases exactly as a synchronous save does, so every guarantee
holds: the checkpoint becomes ``newest`` only when every rank's part is durable, a crash at any
moment leaves the previous newest intact, an error on any rank is an error on every rank.

The background phases are collectives. They run on their own gloo process group, created at the
first asynchronous save by every rank (so never interleaved with the training's collectives on
the default group). At most one save is in flight per job: the next save (synchronous or not),
``wait()`` and the interpreter's exit wait for it first, and raise its error, if it failed, on
every rank. Values are captured when ``save_checkpoint`` is called: training may change the
model at once.

``AsyncSaver`` and ``Stager`` know nothing of partial checkpoints: they run any collective
callable on a staged state, so another checkpoint surface can reuse them.
"""

from __future__ import annotations

import atexit
import copy
import logging
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..tp.layout import from_local_like

logger = logging.getLogger("modelparallel")


class Stager:
    """Host copies of a nested state (dicts, lists, tensors, DTensors, plain values), in buffers
    kept between saves: the same tensors at the same shapes are copied into the same memory."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory held on this rank."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _buffer(self, path: tuple, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            self.buffers[path] = buf
        buf.copy_(t.detach(), non_blocking=False)
        return buf

    def stage(self, state: Any, path: tuple = ()) -> Any:
        """A copy of ``state`` whose tensors live in this stager's buffers (DTensors keep their
        mesh, placements and global shape around a host copy of their shard)."""
        if isinstance(state, DTensor):
            return from_local_like(self._buffer(path, state.to_local()), state)
        if isinstance(state, torch.Tensor):
            return self._buffer(path, state)
        if isinstance(state, dict):
            out = copy.copy(state)  # keeps the type (OrderedDict, defaultdict)
            out.update((k, self.stage(v, (*path, k))) for k, v in state.items())
            return out
        if isinstance(state, (list, tuple)):
            return type(state)(self.stage(v, (*path, i)) for i, v in enumerate(state))
        return copy.deepcopy(state)


class AsyncSaver:
    """A job's background checkpoint writer: one save in flight at a time, its error kept and
    raised by ``wait`` on every rank."""

    def __init__(self):
        self.stager = Stager()
        self.group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.tag: str | None = None
        self._registered = False

    def process_group(self) -> dist.ProcessGroup | None:
        """The background group (a collective the first time: call it on every rank)."""
        if self.group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")
        return self.group

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, tag: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` (the save's collective phases on ``self.group``) in the background, after
        the save in flight (if any) finished."""
        self.wait()
        self.tag = tag
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"modelparallel-save-{tag}", daemon=True)
        self._thread.start()
        if not self._registered:
            atexit.register(_finish_at_exit, weakref.ref(self))
            self._registered = True

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised by wait() on this rank
            self._error = e

    def wait(self) -> None:
        """Wait for the save in flight; raise its error (every rank's background save raises the
        same ``CheckpointError``, so every rank raises it here)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def _finish_at_exit(ref) -> None:
    """At interpreter exit: wait for the save in flight, or say which checkpoint is not
    committed."""
    saver = ref()
    if saver is None or saver._thread is None:
        return
    tag = saver.tag
    try:
        saver.wait()
    except BaseException as e:  # noqa: BLE001 - nothing left to raise to
        logger.error("asynchronous checkpoint %r was not committed: %s", tag, str(e).splitlines()[0])
