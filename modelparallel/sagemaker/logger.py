"""``get_logger``: the library's logger for scripts (SageMaker v2's ``torch.sagemaker.logger``)."""

from __future__ import annotations

import logging
import os

from .. import runtime


def get_logger(name: str | None = None) -> logging.Logger:
    """The ``modelparallel`` logger (or its child ``modelparallel.<name>``), printing INFO lines
    prefixed with the rank, the same handler ``init`` sets up; usable before ``init`` (the rank
    is then the launcher's ``RANK``). A handler the user configured is kept."""
    runtime.configure_logging(int(os.environ.get("RANK", 0)))
    base = logging.getLogger("modelparallel")
    return base.getChild(name) if name else base
