"""Activation checkpointing on PyTorch's non-reentrant ``torch.utils.checkpoint``.

A checkpointed region keeps only its inputs for backward and recomputes everything inside when
backward reaches it. Three entry points share one runner:

- ``set_activation_checkpointing(module, ...)`` marks a module instance: its forward is replaced
  on the instance (parameter names, state dicts and hooks stay as they are), so it works before
  or after ``DistributedModel`` wraps the model and composes with tensor-parallel styles, which
  run as hooks around the forward.
- ``checkpoint(module, *args)`` checkpoints one call.
- ``checkpoint_sequential(sequential, input, strategy)`` checkpoints an ``nn.Sequential`` call
  in segments.

Segments of a container follow a strategy: ``"each"`` (one region per layer), ``"contiguous"``
(consecutive layers on the same pipeline stage in one region; with a single stage, the whole
container) or ``"group_N"`` (N consecutive layers per region, the last one possibly shorter).
When the job enables activation offloading, each region's saved inputs go to host memory
(``offload.py``).
"""

from __future__ import annotations

import logging
import re
import types
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .. import runtime
from .offload import offloader_for

logger = logging.getLogger("modelparallel")

STRATEGIES = ("each", "contiguous", "group_N")
_GROUP = re.compile(r"group_(\d+)")


def segments(num_layers: int, strategy: str, what: str = "module") -> list[range]:
    """Split ``num_layers`` consecutive layers into checkpoint regions.

    Args:
        num_layers: layers in the container.
        strategy: ``"each"``, ``"contiguous"`` or ``"group_N"`` with N >= 1.
        what: the container's name, for the error message.

    Returns:
        Ranges of layer indices, in order, covering every layer once.

    Raises:
        ValueError: for an unknown strategy or a ``group_N`` whose N is not a positive integer.
    """
    if strategy == "each":
        size = 1
    elif strategy == "contiguous":  # one pipeline stage holds every layer
        size = max(num_layers, 1)
    else:
        match = _GROUP.fullmatch(strategy) if isinstance(strategy, str) else None
        if match is None:
            raise ValueError(f"activation checkpointing strategy {strategy!r} for {what} is unknown; "
                             f"use 'each', 'contiguous' or 'group_N' with N a positive integer (e.g. 'group_2')")
        size = int(match.group(1))
        if size < 1:
            raise ValueError(f"activation checkpointing strategy {strategy!r} for {what}: N must be >= 1")
    return [range(i, min(i + size, num_layers)) for i in range(0, num_layers, size)]


def job_offloader():
    """The running job's activation offloader (None without a job, or with offloading off),
    kept on its runtime: the checkpointed regions and the offload wrappers of one job share it."""
    if not runtime.is_initialized():
        return None
    rt = runtime.current()
    return offloader_for(rt.config, rt.offloaders)


def _is_cache(value) -> bool:
    return hasattr(value, "get_seq_length") and hasattr(value, "update")  # a transformers key/value cache


def _without_cache(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with any key/value cache replaced by ``None`` (and ``use_cache`` off).

    A layer appends its keys and values to the cache it is given; recomputing it in backward
    would append them a second time. An empty cache changes nothing in the layer's output, so
    the layer runs without one (as Hugging Face's own gradient checkpointing does).

    Raises:
        NotImplementedError: if the cache already holds tokens the layer would attend to.
    """
    caches = [v for v in (*args, *kwargs.values()) if _is_cache(v)]
    if not caches and not kwargs.get("use_cache"):
        return args, kwargs
    if any(c.get_seq_length() > 0 for c in caches):
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise NotImplementedError(
            f"activation checkpointing of {name} with a filled key/value cache (past_key_values): its "
            f"recomputation would extend the cache twice; run without a cache or under torch.no_grad()")
    runtime.log_once(logger, "activation-checkpointed layers run without their key/value cache (recomputation "
                     "would fill it twice); the model returns an empty cache")
    args = tuple(None if _is_cache(v) else v for v in args)
    kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def run_checkpointed(fn, args: tuple, kwargs: dict, preserve_rng_state: bool = True):
    """``fn(*args, **kwargs)`` as one checkpointed region (offloaded when the job says so).

    Without gradients there is nothing to save, so ``fn`` simply runs.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    args, kwargs = _without_cache(fn, args, kwargs)
    offloader = job_offloader()
    with offloader.region() if offloader is not None else nullcontext():
        return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def _run_layers(layers: list[nn.Module], packed: bool):
    def run(*xs):
        x = tuple(xs) if packed else xs[0]
        for layer in layers:
            x = layer(x)
        return x
    return run


def run_sequential(layers: list[nn.Module], inp, strategy: str, preserve_rng_state: bool, what: str):
    """Feed ``inp`` through ``layers`` in order, one checkpointed region per segment.

    A tuple flowing between layers is unpacked into the region's arguments, so each of its
    tensors is saved (and offloaded) as a region input in its own right.
    """
    x = inp
    for seg in segments(len(layers), strategy, what):
        packed = isinstance(x, tuple)
        run = _run_layers([layers[i] for i in seg], packed)
        x = run_checkpointed(run, x if packed else (x,), {}, preserve_rng_state)
    return x


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """The replacement forward, bound to the instance: the original one, as checkpointed region(s)."""
    cfg = self._mp_activation_checkpointing
    if isinstance(self, nn.Sequential) and not kwargs and len(args) == 1:
        return run_sequential(list(self), args[0], cfg["strategy"], cfg["preserve_rng_state"], type(self).__name__)
    return run_checkpointed(self._mp_original_forward, args, kwargs, cfg["preserve_rng_state"])


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False, strategy: str = "each") -> None:
    """Checkpoint ``module``'s activations from now on (SageMaker's ``smp.set_activation_checkpointing``).

    Args:
        module: an ``nn.Module`` instance. An ``nn.Sequential`` is split into regions by
            ``strategy``; an ``nn.ModuleList`` (whose parent calls the layers one by one) gets
            each layer checkpointed; any other module is one region. Calling it again on the same
            module replaces the settings.
        preserve_rng_state: replay the forward's random state during recomputation, so dropout
            masks are the same as without checkpointing.
        pack_args_as_tuple: accepted for compatibility; a tuple passed between a container's
            layers is always unpacked into the region's inputs.
        strategy: ``"each"``, ``"contiguous"`` or ``"group_N"``; only for containers.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
        ValueError: for an unknown strategy, or ``strategy``/``pack_args_as_tuple`` given for a
            module that is not a container.
        NotImplementedError: for ``"contiguous"``/``"group_N"`` on an ``nn.ModuleList``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_activation_checkpointing needs an nn.Module instance, got {type(module).__name__}")
    name = type(module).__name__
    is_list = isinstance(module, nn.ModuleList)
    if not isinstance(module, (nn.Sequential, nn.ModuleList)) and (strategy != "each" or pack_args_as_tuple):
        raise ValueError(f"strategy={strategy!r} and pack_args_as_tuple={pack_args_as_tuple!r} apply to an "
                         f"nn.Sequential or nn.ModuleList only; {name} is checkpointed as one region")
    segments(len(module) if isinstance(module, (nn.Sequential, nn.ModuleList)) else 1, strategy, name)
    if is_list:
        if strategy != "each":
            raise NotImplementedError(
                f"strategy {strategy!r} on an nn.ModuleList: its parent calls the layers one at a time, so "
                f"layers cannot be grouped into one region; use strategy='each', or an nn.Sequential")
        for layer in module:
            set_activation_checkpointing(layer, preserve_rng_state=preserve_rng_state)
        return
    module._mp_activation_checkpointing = {"strategy": strategy, "preserve_rng_state": preserve_rng_state}
    if "_mp_original_forward" not in module.__dict__:
        module._mp_original_forward = module.forward
        # bound methods, so a deep copy of the module calls its own forward, not the original's
        module.forward = types.MethodType(_checkpointed_forward, module)


def is_activation_checkpointed(module: nn.Module) -> bool:
    """Whether ``set_activation_checkpointing`` was applied to this module instance."""
    return "_mp_activation_checkpointing" in module.__dict__
