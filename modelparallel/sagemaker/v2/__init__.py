"""SageMaker v2's ``torch.sagemaker`` (what ``import torch.sagemaker as tsm`` gives under the import
hook): every name of ``import modelparallel as smp``; its ``init`` and ``transform`` install v2's
PyTorch patches (``contract``). The PyTorch patches themselves live here too (``fsdp1``,
``fsdp1_dtensor_views``, ``fsdp1_tp_state``)."""

from __future__ import annotations

import importlib

from .contract import init, transform


def __getattr__(name: str):
    return getattr(importlib.import_module("modelparallel"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(importlib.import_module("modelparallel"))))
