"""The constructor arguments of the distributed modules, for ``tensor_parallelism(**kwargs)``."""

from __future__ import annotations

import functools
import inspect


def init_params(cls: type) -> set[str]:
    """Names ``cls.__init__`` accepts (excluding ``self`` and ``*args`` / ``**kwargs``)."""
    sig = inspect.signature(cls.__init__)
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n for n, p in list(sig.parameters.items())[1:] if p.kind not in kinds}


@functools.cache
def constructor_args() -> frozenset[str]:
    """Every keyword some built-in distributed module's constructor takes."""
    from . import __all__ as names
    from . import __dict__ as scope

    out: set[str] = set()
    for name in names:
        if name.startswith("Distributed"):
            out |= init_params(scope[name])
    return frozenset(out)
