"""``timeit``: log how long a block took (SageMaker v2's ``torch.sagemaker.utils.utils``);
``paused_gc``: Python's cyclic garbage collector off for a block."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger("modelparallel")


@contextlib.contextmanager
def timeit(enabled: bool = True, message: str = "", rank: int = 0) -> Iterator[None]:
    """Time the block and log ``"<message>: <seconds> s"`` on rank 0 (``rank`` is the caller's
    global rank, so only one rank of a job logs). Nothing is measured when not ``enabled``."""
    if not enabled:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        if rank == 0:
            logger.info("%s: %.3f s", message or "elapsed", time.perf_counter() - start)


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
