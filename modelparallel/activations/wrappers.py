"""PyTorch's activation wrappers (``checkpoint_wrapper``, ``offload_wrapper``; what
``apply_activation_checkpointing`` puts around each block) set aside while a model is
parallelized.

A script may wrap the blocks before handing the model to ``smp.DistributedModel`` (v1) or
``smp.transform`` (v2). The wrapper
adds a path segment (``layers.0._checkpoint_wrapped_module.self_attn``), so the architecture's
plans, written against the model's own paths, would match nothing under it. ``lifted`` puts each
wrapped module in its wrapper's place for the duration, and the wrappers back around whatever
is then in that place (the parallelized block; nothing where the pipeline split removed it),
so the parallelized model checkpoints as the script asked, as if it had wrapped the blocks
afterwards. Marks the caller names (a partition index ``smp.set_partition``
put on the wrapper, the entry the script sees) are copied to the wrapped module meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ..compat import torch_checkpoint_wrappers as _wrappers

INNER = "_checkpoint_wrapped_module"
"""Where PyTorch's activation wrappers hold the module they wrap."""


def _next_wrapper(module: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """(parent, name, wrapper) of the first activation wrapper below ``module``, or None."""
    for parent in module.modules():
        for name, child in parent._modules.items():
            if isinstance(child, _wrappers.ActivationWrapper):
                return parent, name, child
    return None


@contextmanager
def lifted(module: nn.Module, marks: tuple[str, ...] = (), caller: str = "smp.DistributedModel") -> Iterator[None]:
    """While inside, ``module`` holds no activation wrapper (see the module docstring); the
    attributes ``marks`` that a wrapper has and its wrapped module lacks are the wrapped module's.

    Raises:
        ValueError: for an activation wrapper that is ``module`` itself (nothing to put back
            around: wrap the model after ``caller``, the entry named in the message).
    """
    if isinstance(module, _wrappers.ActivationWrapper):
        raise ValueError(f"{caller} of a {type(module).__name__} (an activation checkpoint or offload "
                         f"wrapper around the whole model): pass the model itself, and wrap what {caller} returns")
    taken = []
    while (found := _next_wrapper(module)) is not None:
        parent, name, wrapper = found
        inner = parent._modules[name] = wrapper._modules[INNER]
        copied = [m for m in marks if m in wrapper.__dict__ and m not in inner.__dict__]
        inner.__dict__.update((m, wrapper.__dict__[m]) for m in copied)
        taken.append((parent, name, wrapper, inner, copied))
    try:
        yield
    finally:
        for parent, name, wrapper, inner, copied in reversed(taken):  # inner wrappers first, as nested
            for m in copied:
                inner.__dict__.pop(m, None)
            if parent._modules.get(name) is not None:
                wrapper._modules[INNER] = parent._modules[name]
                parent._modules[name] = wrapper
