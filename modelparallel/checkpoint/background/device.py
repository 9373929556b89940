"""Staging tensors that live on a GPU without pinning host memory in the call.

An asynchronous save's call returns once what it saves is safe from the training that goes on.
For a deferred GPU tensor (one only the optimizer's step changes) ``Stager.defer`` takes the first
of three ways that applies:

1. ``stream``: a pinned host buffer from an earlier save fits: the call enqueues ``word_sum`` of
   the tensor on its stream and the copy on a side stream after the work enqueued so far, and
   returns; the copy overlaps the next forward and backward, the optimizer's next step makes its
   stream wait for it (the host does not wait), and the background thread compares the copy's
   ``word_sum`` with the call's (a change through ``.data`` meanwhile is not ordered after it).
2. ``snapshot``: the device has room (``Room``): the call enqueues a device-to-device copy on the
   tensor's stream (milliseconds for gigabytes); the background thread moves it to the host and
   frees it. The step is not held for it.
3. ``live``: no room: the call only enqueues ``word_sum`` of the tensor (one read at device
   memory speed); the background thread copies the live tensor on a stream of its own while the
   forward and backward run, the optimizer's next step waits for that copy on the host (as for
   host tensors), and the copy's ``word_sum`` must equal the call's.

A ``word_sum`` that differs fails the save on every rank, naming the tensor: a change through
``.data`` does not move the version counter.

Pinning host memory is slow (about 1 s per GB on an H100 host: 7.7 s for a 7.6 GB checkpoint), so
a GPU tensor's first buffer is ordinary host memory; ``Pinner`` replaces those by pinned ones in
the background once that save is written, so that later saves take way 1.
"""

from __future__ import annotations

import threading

import torch

CHUNK_WORDS = 1 << 22
"""Words per partial sum in ``word_sum``: bounds the temporary a widening sum may allocate."""

MARGIN_BYTES = 1 << 30
"""Device memory ``Room`` always leaves free (at least; or a twentieth of the device)."""


def _as_words(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (bytes) read as the widest integer words its size and alignment allow."""
    for dtype, width in ((torch.int64, 8), (torch.int32, 4)):
        if flat.numel() % width == 0 and flat.data_ptr() % width == 0:
            try:
                return flat.view(dtype)
            except RuntimeError:  # an offset the view refuses: a narrower word
                continue
    return flat


def word_sum(t: torch.Tensor) -> torch.Tensor:
    """A 64-bit fingerprint of a contiguous tensor's bytes, as an int64 scalar on its device: the
    bytes read as integer words, summed per chunk, each chunk's sum weighted by its position.
    Integer sums wrap, so every device and summation order gives the same value: the call takes
    it on the GPU (asynchronously, one read) and the background thread on the host copy. Any
    change of one value changes it; only a reordering within a chunk would not."""
    words = _as_words(t.detach().reshape(-1).view(torch.uint8))
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for i, chunk in enumerate(words.split(CHUNK_WORDS)):
        total += chunk.sum(dtype=torch.int64) * (i + 1)
    return total


def spare_bytes(device: torch.device) -> int:
    """Device memory a snapshot may take without making the training's next steps run out: what
    this process can hold (free now plus what its allocator reserves) less the most it has
    reserved so far (the training's peak, reached in earlier steps) and a margin. None on a
    host (a snapshot there is a copy in the call), and none before the peak shows a step (it
    stands at least an eighth above what is held now: activations come and go), e.g. a save
    right after loading: the next step's peak is then unknown."""
    if device.type != "cuda":
        return 0
    now, most = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    if most < now + now // 8:  # no forward and backward seen yet: the peak says nothing of the next one
        return 0
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_reserved(device)
    return free + held - peak - max(MARGIN_BYTES, total // 20)


class Room:
    """The device memory one save's snapshots may still take, per device (asked once per save)."""

    def __init__(self, spare=spare_bytes):
        self.spare = spare
        self.left: dict[torch.device, int] = {}

    def take(self, t: torch.Tensor) -> bool:
        """Whether ``t`` may be snapshot on its device (its bytes are then counted as taken)."""
        if t.device not in self.left:
            self.left[t.device] = self.spare(t.device)
        need = t.numel() * t.element_size()
        if need > self.left[t.device]:
            return False
        self.left[t.device] -= need
        return True


class Streams:
    """One side stream per device for the background thread's copies (made on first use)."""

    def __init__(self):
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def of(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]


class Pinner:
    """Replaces the pageable host buffers of GPU tensors by pinned ones, in a thread of its own,
    one buffer at a time, under the stager's ``lock``. ``halt`` (a save's call, before it reads
    the buffers) stops all swapping at once without waiting for the allocation in hand, which
    that thread then drops."""

    def __init__(self, lock: threading.Lock, allocate=None):
        self._lock = lock
        self.allocate = allocate or (lambda old: torch.empty(old.shape, dtype=old.dtype, device="cpu", pin_memory=True))
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, buffers: dict, pageable: set) -> None:
        self.stop()
        with self._lock:
            keys = list(pageable)
        if not keys:
            return
        self._halt = threading.Event()  # the thread's own flag
        self._thread = threading.Thread(target=self._run, args=(buffers, pageable, keys, self._halt),
                                        name="modelparallel-pin", daemon=True)
        self._thread.start()

    def _run(self, buffers: dict, pageable: set, keys: list, halt: threading.Event) -> None:
        for key in keys:
            old = buffers.get(key)
            if halt.is_set():
                return
            if old is None:
                continue
            new = self.allocate(old)
            with self._lock:
                if halt.is_set():
                    return
                if buffers.get(key) is old:
                    buffers[key] = new
                    pageable.discard(key)

    def halt(self) -> None:
        """No buffer is swapped after this returns."""
        with self._lock:
            self._halt.set()

    def join(self) -> None:
        """Wait until the buffers are pinned (or the thread halted)."""
        if self._thread is not None:
            self._thread.join()

    def stop(self) -> None:
        """Halt, and wait for the thread to end (its allocation in hand included)."""
        self.halt()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
