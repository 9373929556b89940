"""Hugging Face state-dict translation, with SageMaker's import paths and function names.

The key tables and the translation live with the architectures (``modelparallel/models/``); the
modules here only give them SageMaker's names (``gpt2``, ``gptj``...), imported on first use.
"""

from __future__ import annotations

import importlib

SAGEMAKER_MODULES = ("bert", "gpt2", "gptj", "gptneo", "llama", "roberta")
"""The modules holding SageMaker's translation function names."""


def __getattr__(name: str):
    if name in SAGEMAKER_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
