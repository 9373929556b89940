"""Hugging Face state-dict translation, with SageMaker's import paths and function names.

The key tables live with their architectures (``modelparallel/models/<arch>.py``); the modules
here only give them SageMaker's names. ``to_hf_items`` / ``from_hf_items`` translate one entry at
a time (for streaming exports); ``table_for`` finds a ``model_type``'s key table.
"""

from __future__ import annotations

import importlib

import torch

from . import translate as _t


def table_for(model_type: str | None) -> _t.KeyTable | None:
    """The key table of an HF ``model_type``, or None if it has no translation."""
    from ...models import architecture_for  # the architectures import this package's engine

    return getattr(architecture_for(model_type), "table", None) if model_type else None


SAGEMAKER_MODULES = ("bert", "gpt2", "gptj", "gptneo", "llama", "roberta")
"""The modules holding SageMaker's translation names, imported on first use: they read the key
tables from ``modelparallel.models``, whose files import this package's engine."""


def __getattr__(name: str):
    if name == "TABLES":  # model_type -> key table, every built-in architecture
        from ...models import BUILT_IN

        return {t: a.table for t, a in BUILT_IN.items()}
    if name in SAGEMAKER_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _known(model_type: str) -> _t.KeyTable:
    table = table_for(model_type)
    if table is None:
        raise KeyError(f"no state-dict translation for model_type {model_type!r} (no modelparallel/models file)")
    return table


def to_hf_items(model_type: str, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One distributed-format entry of a ``model_type`` model as HF entries (``KeyError`` for an
    unknown architecture or key)."""
    return _t.to_hf_items(_known(model_type), key, tensor)


def from_hf_items(model_type: str, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One HF entry of a ``model_type`` model in distributed format (``KeyError`` for an unknown
    architecture or key)."""
    return _t.from_hf_items(_known(model_type), key, tensor)
