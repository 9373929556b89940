"""Marks given to modules as they are created inside a ``with`` block.

``smp.tensor_parallelism()`` and ``smp.partition(i)`` both mark every module built inside their
block, the innermost block winning, and leave modules marked explicitly alone. A module-
registration hook does it: every module assigned as a child while a block is open gets the
innermost block's mark as an attribute, unless it has one. The hook is installed only while a
block is open, so module creation elsewhere pays nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook


class CreationMarks:
    """The open blocks of one kind of mark (stored on modules as ``attr``)."""

    def __init__(self, attr: str):
        self.attr = attr
        self.stack: list[Any] = []
        self._handle = None

    def _tag(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        if child is not None and self.stack and self.attr not in child.__dict__:
            setattr(child, self.attr, self.stack[-1])

    @contextlib.contextmanager
    def marking(self, mark: Any):
        """Give ``mark`` to the modules created while the block runs."""
        self.stack.append(mark)
        if len(self.stack) == 1:
            self._handle = register_module_module_registration_hook(self._tag)
        try:
            yield
        finally:
            self.stack.pop()
            if not self.stack:
                self._handle.remove()
                self._handle = None
