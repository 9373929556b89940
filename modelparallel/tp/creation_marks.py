"""Marks given to modules as they are created inside a ``with`` block.

``smp.tensor_parallelism()`` and ``smp.partition(i)`` both mark every module built inside their
block, the innermost block winning, and leave modules marked explicitly alone. A module-
registration hook does it: every module assigned as a child while a block is open gets the
innermost block's mark as an attribute, unless it has one. The hook is installed only while a
block is open, so module creation elsewhere pays nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook


class CreationMarks:
    """The open blocks of one kind of mark (stored on modules as ``attr``). The open blocks are
    kept per context (a ``ContextVar``), not in the object: another thread creating modules
    while a block is open is not marked by it."""

    def __init__(self, attr: str):
        self.attr = attr
        self._open: contextvars.ContextVar[tuple] = contextvars.ContextVar(f"modelparallel_{attr}", default=())

    def _tag(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        open_blocks = self._open.get()
        if child is not None and open_blocks and self.attr not in child.__dict__:
            setattr(child, self.attr, open_blocks[-1])

    @contextlib.contextmanager
    def marking(self, mark: Any):
        """Give ``mark`` to the modules created while the block runs."""
        token = self._open.set(self._open.get() + (mark,))
        handle = register_module_module_registration_hook(self._tag)
        try:
            yield
        finally:
            handle.remove()
            self._open.reset(token)
