"""Host copies of what an asynchronous save writes, in buffers kept from one save to the next.

``Stager.stage`` copies a nested state (dicts, lists, tensors, DTensors) into one buffer per tensor,
reused by the next save when shapes and dtypes match. What only an optimizer step changes
(parameters, optimizer slots, fp32 masters) may be left to the background thread (``defer``),
while the call copies at once what a forward can change (buffers, the loss scaler, step counters,
anything else); the optimizer's step waits until that copy is done (``async_save.Job.hold``).
Anything else that changes a deferred tensor in place, by any means (``p.data.mul_()``, a numpy
view, another thread), is caught on the memory itself: where the kernel tracks writes
(``pages``), the call write-protects the tensor's pages and the background thread asks, after its
copy, whether any was written; elsewhere the call takes the CRC32 of the tensor's bytes (a read at
memory speed, about half the cost of copying them) and the background thread compares it with
the CRC32 of its copy. A tensor written in between fails that save on every rank, naming it, so a
checkpoint never holds values other than the call's. The
version counters of the tensor and its aliases (FSDP's original parameters over a flat one) are
compared too, which also refuses a change through an alias that missed the saved memory. A
deferred tensor on a GPU takes one of the ways in ``device`` (a copy ordered on its stream, a
snapshot on the device, or a live copy checked by a sum), none of which pins memory in the call.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from ...tp.layout import from_local_like
from .deferred import HOST, LIVE, SNAPSHOT, STREAM, Deferred, Early, fingerprint
from .device import Pinner, Room, Streams, spare_bytes, word_sum
from .pages import PageWatch

_UNOPENED = object()


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
        self.on_device: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda
        """Which tensors take a GPU tensor's ways (``device``; tests send host tensors there)."""
        self.spare: Callable[[torch.device], int] = spare_bytes
        """Device memory a save's snapshots may take (``device.Room``)."""
        self.room = Room(self.spare)
        self.pageable: set = set()
        """Keys of GPU tensors' buffers still in ordinary host memory (``device.Pinner`` pins them)."""
        self._lock = threading.Lock()
        self.pinner = Pinner(self._lock)
        self.streams = Streams()
        self._pages: Any = _UNOPENED
        self._pages_started = False
        """``fingerprint_early`` began this save's watch (its mappings read once per save)."""

    @property
    def pages(self) -> PageWatch | None:
        """The kernel's write tracking for deferred host tensors (opened at the first use; None
        where unavailable, and where a test sets it so: the call reads the tensors instead)."""
        if self._pages is _UNOPENED:
            self._pages = PageWatch.open()
        return self._pages

    @pages.setter
    def pages(self, watch: PageWatch | None) -> None:
        self._pages = watch

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory held on this rank."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def begin(self) -> None:
        """Start a save's staging: the pinning thread halted (it swaps buffers), counts reset."""
        self.pinner.halt()
        self.copied_bytes = self.deferred_bytes = 0
        self.room = Room(self.spare)
        if self.pages is not None and not self._pages_started:
            self.pages.start()
        self._pages_started = False

    def abandon(self) -> None:
        """A save failed before its deferred copies: drop them and clear their page protections."""
        self.deferred.clear()
        if self.pages is not None:
            self.pages.start()

    def settle(self) -> None:
        """After the held steps were released: end the save's page registrations (``pages``)."""
        if self.pages is not None:
            self.pages.unregister()

    def pin_later(self) -> None:
        """After a save is written: pin GPU tensors' buffers in the background (``device``); the
        DTensors around the old buffers are dropped with them."""
        if self.pageable:
            self.wrappers.clear()
            self.pinner.start(self.buffers, self.pageable)

    def buffer(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        """The buffer kept under ``key`` for a tensor like ``t`` (a new one if none fits; for a
        GPU tensor in ordinary host memory: pinning it would hold the call, see ``device``)."""
        with self._lock:
            buf = self.buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                (self.pageable.add if t.is_cuda else self.pageable.discard)(key)
            return buf

    def fingerprint_early(self, tensors: list[torch.Tensor] | None) -> None:
        """Start the CRC32s of ``tensors`` (those ``defer`` will get) in a thread now, so that
        the call's other work (state dicts, collectives) overlaps their reading; the save's
        call must not return before ``defer`` took them. ``None``: drop what is left. Without a
        core to spare for them (``Early.pays``) nothing starts: ``defer`` reads them itself.
        Tensors whose writes the kernel tracks (``pages``) are not read."""
        self._pages_started = bool(tensors) and self.pages is not None
        if self._pages_started:  # this save's watch begins here (``begin`` then leaves it)
            self.pages.start()
            if Early.pays():
                tensors = [t for t in tensors if not self.pages.eligible(t)]
        self._early = Early(tensors) if tensors and Early.pays() else None

    def _crc(self, local: torch.Tensor) -> int:
        early = self._early.take(local) if self._early is not None else None
        return early if early is not None else fingerprint(local)

    def defer(self, name: str, source: torch.Tensor, local: torch.Tensor, buf: torch.Tensor,
              aliases: tuple = ()) -> None:
        """Leave the copy of ``local`` (``source``'s local tensor) into ``buf`` to
        ``copy_deferred``, write-protecting its pages (``pages``) or recording the CRC32 of its
        bytes now, and the version counters of
        ``source``, ``local`` and ``aliases`` (e.g. FSDP's original parameters over a flat one).
        A GPU tensor takes one of the ways in ``device``; a non-contiguous host one is copied now."""
        watched = (source, local, *aliases)
        if self.on_device(local):
            self.deferred.append(self._on_device(name, local, buf, watched))
        elif not local.is_contiguous():
            self.copy_now(local, buf)
            return
        else:  # an alias of the call's memory: ``p.data = x`` or ``set_`` on the tensor later moves it, not the copy
            local, watch = local.detach(), self.pages
            pages = watch.claim(local) if watch is not None else None
            crc = pages.edges(local) if pages is not None else self._crc(local)
            self.deferred.append(Deferred(name, buf, local, HOST, crc, None, watched, pages=pages))
        self.deferred_bytes += buf.numel() * buf.element_size()

    def seal(self) -> None:
        """End the call's staging: the claimed pages write-protected at once (``pages``); a tensor
        whose pages the kernel refused is read now instead."""
        if self.pages is None:
            return
        failed = {id(mark) for mark in self.pages.protect_claimed()}
        for d in self.deferred:
            if d.pages is not None and id(d.pages) in failed:
                d.pages, d.crc = None, self._crc(d.local)

    def _on_device(self, name: str, local: torch.Tensor, buf: torch.Tensor, watched: tuple) -> Deferred:
        """A GPU tensor's way (``device``): a copy on a side stream into a pinned buffer, a
        snapshot on the device where there is room, else a live copy in the background; the
        first and the last are checked by ``word_sum`` (the stream copy by no version counter:
        the optimizer's step moves it legitimately before the background thread looks)."""
        local = local.detach()
        if local.is_cuda and buf.is_pinned():
            return Deferred(name, buf, local, STREAM, word_sum(local), self._copied_aside(local, buf))
        if self.room.take(local):
            return Deferred(name, buf, local.clone(), SNAPSHOT, None, _recorded(local))
        return Deferred(name, buf, local, LIVE, word_sum(local), _recorded(local), watched)

    def _copied_aside(self, local: torch.Tensor, buf: torch.Tensor):
        """Enqueue the copy of ``local`` into pinned ``buf`` on the device's side stream, after
        the work enqueued so far on the current one; the event after it (the optimizer's step
        makes its stream wait for it: ``stream_events``)."""
        side = self.streams.of(local.device)
        side.wait_stream(torch.cuda.current_stream(local.device))
        with torch.cuda.stream(side):
            buf.copy_(local, non_blocking=True)
            return _recorded(local)

    def stream_events(self) -> list:
        """(device, the last side-stream copy's event there) of the save staged: a step waits
        for these on its own stream, not on the host."""
        return list({d.local.device: d.event for d in self.deferred if d.kind == STREAM}.items())

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
        self.begin()
        with torch.no_grad():
            staged = self._stage(state, defer, ())
        self.seal()
        return staged

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

    def copy_deferred(self, live: bool = True) -> None:
        """Fill the deferred buffers whose copies read live memory (``live``: the optimizer's
        step waits for these), or the others (snapshots, stream copies); raise
        ``StagedTensorChanged`` naming every tensor whose copy does not hold the bytes it had at
        ``stage`` (changed in place by any means since, or during the copy) or whose version
        counter (or an alias's) moved."""
        pending = [d for d in self.deferred if d.reads_live == live]
        self.deferred = [d for d in self.deferred if d.reads_live != live]
        try:
            if self.before_copy is not None and pending:
                self.before_copy()
            with torch.no_grad():
                changed = [d.name for d in pending if not d.copy(self.streams)]
        finally:
            if live and self.pages is not None:  # each copy was checked right after it was made
                self.pages.release()
        if changed:
            raise StagedTensorChanged(
                f"{len(changed)} tensor(s) changed in place after {self.wording[0]} returned and before they were "
                f"staged: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}. {self.wording[1]}")


def _recorded(t: torch.Tensor):
    """An event recorded on ``t``'s current GPU stream after the work enqueued so far (none for a
    host tensor: its work is done when enqueued)."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event
