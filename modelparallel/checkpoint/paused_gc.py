"""``paused_gc``: Python's cyclic garbage collector off for a block (checkpoint saves and loads)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, then as it was (also as a decorator).

    Why: a checkpoint's collectives unpickle thousands of small objects on the coordinator
    (DCP's plans and write results), which sets off a full collection over every object of the
    process (the model's modules, torch's and transformers' own): measured 0.27 s of a 3 s save
    of a medium model, on rank 0 only while the others waited. What the block creates is freed by
    reference counting as usual; cycles wait for the next collection after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
