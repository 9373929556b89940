"""One way to wrap a PyTorch function in place for SageMaker's call forms and v2's patches: at
most once per wrapper kind (a module of its own, so the launcher's call forms import no engine).

Every v2 patch replaces a PyTorch attribute (a method of FSDP1's handle, a hook of its state dict
code) with a wrapper around it; ``init`` and ``transform`` install the patches each time they run,
so a wrapper must not wrap itself. Each patching module passes its own ``mark``: patches of two
modules on one function stack, a second install of the same one is a no-op.
"""

from __future__ import annotations

import functools
from typing import Any, Callable


def wrap_once(owner: Any, name: str, wrap: Callable[[Callable], Callable], mark: str) -> None:
    """Set ``owner.name`` to ``wrap(original)`` (given the original's name and docstring), unless
    the current one is already a wrapper marked ``mark``; a static method of a class stays one."""
    raw = vars(owner).get(name) if isinstance(owner, type) else None
    static = isinstance(raw, staticmethod)
    original = raw.__func__ if static else getattr(owner, name)
    if getattr(original, mark, False):
        return
    wrapped = functools.wraps(original)(wrap(original))
    setattr(wrapped, mark, True)
    setattr(owner, name, staticmethod(wrapped) if static else wrapped)
