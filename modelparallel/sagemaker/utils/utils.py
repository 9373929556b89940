"""``timeit``: log how long a block took (SageMaker v2's ``torch.sagemaker.utils.utils``)."""

from __future__ import annotations

import contextlib
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
