"""``smp.patches.checkpoint``: checkpoint one module call, or an ``nn.Sequential`` in segments.

Both run on PyTorch's non-reentrant ``torch.utils.checkpoint`` (see ``modelparallel.activations``),
so they compose with tensor-parallel modules, nested tuples as inputs, and activation offloading.
"""

from __future__ import annotations

import torch
from torch import nn

from ...activations.checkpointing import run_checkpointed, run_sequential, segments


def checkpoint(module: nn.Module, *args, preserve_rng_state: bool = True, **kwargs):
    """``module(*args, **kwargs)`` with its activations recomputed in backward instead of kept.

    Args:
        module: the module to call (a module, not a plain function: checkpointing is per module).
        *args: its inputs.
        preserve_rng_state: replay the forward's random state when recomputing (same dropout).
        **kwargs: keyword inputs of the module.

    Returns:
        What ``module`` returns.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint needs an nn.Module to call, got {type(module).__name__} {module!r}; "
                        f"wrap the function in a module")
    return run_checkpointed(module, args, kwargs, preserve_rng_state)


def checkpoint_sequential(sequential_module: nn.Sequential, input, strategy: str = "each",
                          preserve_rng_state: bool = True, pack_args_as_tuple: bool = False):
    """Run an ``nn.Sequential`` on ``input`` with its layers checkpointed in segments.

    Args:
        sequential_module: the ``nn.Sequential`` to run.
        input: a tensor, or a tuple of tensors passed whole to the first layer (as
            ``nn.Sequential`` does).
        strategy: ``"each"`` (one region per layer), ``"contiguous"`` (the whole container: a
            single pipeline stage holds every layer) or ``"group_N"`` (N layers per region).
        preserve_rng_state: replay the forward's random state when recomputing.
        pack_args_as_tuple: accepted for compatibility; tuples work either way.

    Returns:
        The last layer's output.

    Raises:
        TypeError: if ``sequential_module`` is not an ``nn.Sequential``.
        ValueError: for an unknown strategy or a bad N in ``group_N``.
    """
    if not isinstance(sequential_module, nn.Sequential):
        raise TypeError(f"checkpoint_sequential needs an nn.Sequential, got {type(sequential_module).__name__}; "
                        f"use checkpoint(module, ...) for other modules")
    what = type(sequential_module).__name__
    segments(len(sequential_module), strategy, what)
    if not torch.is_grad_enabled():
        return sequential_module(input)
    return run_sequential(list(sequential_module), input, strategy, preserve_rng_state, what)
