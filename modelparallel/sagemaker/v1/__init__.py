"""SageMaker v1's ``smdistributed.modelparallel.torch`` (what ``import smdistributed.modelparallel.
torch as smp`` gives under the import hook): every name of ``import modelparallel as smp``, with
the engine's own ``init``, which installs none of SageMaker v2's PyTorch patches (a v1 job makes no
FSDP1 or DCP calls of its own for them to serve)."""

from __future__ import annotations

import importlib

from ...runtime import init


def __getattr__(name: str):
    return getattr(importlib.import_module("modelparallel"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(importlib.import_module("modelparallel"))))
