"""Hugging Face state-dict translation, with SageMaker's import paths and function names.

The key tables and the translation live with the architectures (``modelparallel/models/``); the
modules here only give them SageMaker's names (``gpt2``, ``gptj``...), imported on first use.
``table_for`` finds a ``model_type``'s key table; ``to_hf_items`` / ``from_hf_items`` translate one
entry of a ``model_type`` model at a time (for streaming exports); ``translate`` has the rest.
"""

from __future__ import annotations

import importlib

from ....models import table_for  # noqa: F401 - re-exported
from ....models._hf_items import from_hf_items, to_hf_items  # noqa: F401 - re-exported

SAGEMAKER_MODULES = ("bert", "gpt2", "gptj", "gptneo", "llama", "roberta")
"""The modules holding SageMaker's translation function names."""


def __getattr__(name: str):
    if name == "TABLES":  # model_type -> key table, every built-in architecture
        built_in = importlib.import_module("modelparallel.models").BUILT_IN
        return {t: a.table for t, a in built_in.items()}
    if name in SAGEMAKER_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
