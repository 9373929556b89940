"""SageMaker v2's activation offloading: PyTorch's ``offload_wrapper`` runs on this library's
offloader when the job sets ``sm_activation_offloading``.

v2 scripts checkpoint each transformer block with PyTorch's ``checkpoint_wrapper`` and then wrap
the whole model with ``offload_wrapper`` (``torch.distributed.algorithms._checkpoint.
checkpoint_wrapper``). PyTorch's wrapper keeps every tensor saved for backward on the host with
``save_on_cpu``, which copies each one into a new plain tensor: a tensor-parallel model saves
DTensors (weights, the inputs of DTensor layers), and the copy fails ("aten.copy_.default got
mixed torch.Tensor and DTensor"). SageMaker replaces that implementation when the key is set;
so does ``install``: with ``sm_activation_offloading`` (or v1's ``offload_activations``) on,
``OffloadWrapper`` saves through ``ActivationOffloader`` (DTensors, parameters and tiny tensors
stay where they are; ``activation_loading_horizon`` regions are loaded back ahead of backward),
each ``CheckpointWrapper`` inside it being one region, and the rest of the forward one more.
With the key off, both wrappers are PyTorch's own.
"""

from __future__ import annotations

import contextvars
import functools
from contextlib import nullcontext

from ..compat import torch_checkpoint_wrappers as _wrappers
from .checkpointing import job_offloader

_MARK = "_mp_offload_wrapper"
_offloading = contextvars.ContextVar("modelparallel_offload_wrapper", default=None)


def _offloading_forward(forward):
    @functools.wraps(forward)
    def offloaded(self, *args, **kwargs):
        offloader = job_offloader()
        if offloader is None:
            return forward(self, *args, **kwargs)
        token = _offloading.set(offloader)
        try:
            with offloader.region():
                return self._checkpoint_wrapped_module(*args, **kwargs)
        finally:
            _offloading.reset(token)
    return offloaded


def _region_per_checkpoint(forward):
    @functools.wraps(forward)
    def checkpointed(self, *args, **kwargs):
        offloader = _offloading.get()
        with offloader.region() if offloader is not None else nullcontext():
            return forward(self, *args, **kwargs)
    return checkpointed


def install() -> None:
    """Wrap ``OffloadWrapper.forward`` and ``CheckpointWrapper.forward`` (idempotent)."""
    for cls, wrap in ((_wrappers.OffloadWrapper, _offloading_forward),
                      (_wrappers.CheckpointWrapper, _region_per_checkpoint)):
        if not getattr(cls.forward, _MARK, False):
            patched = wrap(cls.forward)
            setattr(patched, _MARK, True)
            cls.forward = patched
