"""Activation offloading: the tensors a checkpointed region keeps for backward live on the CPU.

With activation checkpointing, a region keeps only its inputs for backward (everything inside is
recomputed). PyTorch's non-reentrant checkpoint saves those inputs through the saved-tensor hooks
active around the call, so an ``ActivationOffloader.region()`` context around each checkpointed
call moves them to host memory when they are saved and back when backward needs them.

Reloading runs ahead of backward: when backward unpacks a tensor of region ``r`` it also starts
loading the tensors of the ``horizon`` regions saved just before ``r`` (backward visits regions in
reverse order), so they are already on the device when their turn comes. Copies are issued on the
current stream, from pinned memory and non-blocking, so stream order keeps them correct.

A tensor already on the storage device (every tensor of a CPU-only job) is kept as it is: the
bookkeeping and the prefetch order run, nothing moves. Parameters, tensor subclasses (DTensor)
and tensors below ``min_bytes`` are never offloaded: they are either alive anyway or too small
to be worth a transfer.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MIN_OFFLOAD_BYTES = 1024


class _Saved:
    """One saved tensor: where it is stored, and where it came from."""

    __slots__ = ("region", "stored", "device", "loaded", "__weakref__")

    def __init__(self, region: int, stored: torch.Tensor, device: torch.device):
        self.region = region
        self.stored = stored
        self.device = device
        self.loaded: torch.Tensor | None = None


class ActivationOffloader:
    """Saved-tensor hooks that keep checkpointed regions' inputs in host memory until backward.

    Args:
        horizon: how many regions ahead of backward are loaded back (at least 1).
        storage_device: where offloaded tensors are kept.
        force_copy: copy even a tensor that is already on ``storage_device`` (exercises the
            transfer path on CPU-only machines; costs memory, no benefit).

    Raises:
        ValueError: if ``horizon`` < 1.
    """

    def __init__(self, horizon: int = 4, storage_device: str | torch.device = "cpu", force_copy: bool = False):
        if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 1:
            raise ValueError(f"activation_loading_horizon must be an integer >= 1, got {horizon!r}")
        self.horizon = horizon
        self.storage_device = torch.device(storage_device)
        self.force_copy = force_copy
        self._regions = itertools.count()
        self._current_region: int | None = None
        self._live: dict[int, list[weakref.ref]] = {}
        self._lock = threading.Lock()
        self.events: list[tuple[str, int]] | None = None  # ("offload"|"load"|"use", region) when set to []

    @contextmanager
    def region(self) -> Iterator[None]:
        """Offload the tensors saved for backward inside this block as one region."""
        outer = self._current_region
        self._current_region = next(self._regions)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._current_region = outer

    def _pack(self, t: torch.Tensor):
        if type(t) is not torch.Tensor or t.numel() * t.element_size() < MIN_OFFLOAD_BYTES:
            return t  # parameters, DTensors and tiny tensors stay where they are
        region = self._current_region
        if t.device == self.storage_device:
            stored = t.detach().clone() if self.force_copy else t  # already there: nothing to move
        else:
            stored = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=t.device.type == "cuda",
                                 device=self.storage_device).copy_(t, non_blocking=True)
        saved = _Saved(region, stored, t.device)
        with self._lock:
            if region not in self._live:
                self._prune()  # graphs dropped without a backward leave only dead references
            self._live.setdefault(region, []).append(weakref.ref(saved))
        self._record("offload", region)
        return saved

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        self._prefetch_before(saved.region)
        self._load(saved)
        self._record("use", saved.region)
        return saved.loaded

    def _load(self, saved: _Saved) -> None:
        if saved.loaded is None:
            saved.loaded = saved.stored.to(saved.device, non_blocking=True)
            self._record("load", saved.region)

    def _prefetch_before(self, region: int) -> None:
        """Start loading the ``horizon`` live regions saved just before ``region``."""
        with self._lock:
            self._prune()
            earlier = sorted((r for r in self._live if r < region), reverse=True)[: self.horizon]
            todo = [ref() for r in earlier for ref in self._live[r]]
        for saved in todo:
            if saved is not None:
                self._load(saved)

    def _prune(self) -> None:
        """Forget regions whose saved tensors autograd has released (call with the lock held)."""
        for r in [r for r, refs in self._live.items() if all(ref() is None for ref in refs)]:
            del self._live[r]

    def stored_bytes(self) -> int:
        """Bytes of offloaded tensors still waiting for backward (host memory on an accelerator)."""
        with self._lock:
            live = [ref() for refs in self._live.values() for ref in refs]
        return sum(s.stored.numel() * s.stored.element_size() for s in live if s is not None)

    def _record(self, what: str, region: int) -> None:
        if self.events is not None:
            self.events.append((what, region))


def offloader_for(config, kept: dict | None = None) -> ActivationOffloader | None:
    """The offloader for ``config`` (``None`` when offloading is off).

    ``offload_activations`` (v1 name) or ``sm_activation_offloading`` (v2 name) turns it on;
    ``activation_loading_horizon`` sets the prefetch distance. ``kept`` (the job's: the
    runtime's ``offloaders``) holds one offloader per horizon, so its bookkeeping spans every
    checkpointed region of a step; without it a new one is made.
    """
    if config is None:
        return None
    if not (getattr(config, "offload_activations", False) or getattr(config, "sm_activation_offloading", False)):
        return None
    horizon = getattr(config, "activation_loading_horizon", 4)
    if kept is None:
        return ActivationOffloader(horizon)
    if horizon not in kept:
        kept[horizon] = ActivationOffloader(horizon)
    return kept[horizon]
