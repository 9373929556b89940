"""State-dict entries translated one at a time, by Hugging Face ``model_type`` (for streaming
exports and imports that never hold a whole state dict); the key tables are the architectures'."""

from __future__ import annotations

import torch

from . import table_for
from . import _translate as translate


def _known(model_type: str) -> translate.KeyTable:
    table = table_for(model_type)
    if table is None:
        raise KeyError(f"no state-dict translation for model_type {model_type!r} (no modelparallel/models file)")
    return table


def to_hf_items(model_type: str, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One distributed-format entry of a ``model_type`` model as HF entries (``KeyError`` for an
    unknown architecture or key)."""
    return translate.to_hf_items(_known(model_type), key, tensor)


def from_hf_items(model_type: str, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One HF entry of a ``model_type`` model in distributed format (``KeyError`` for an unknown
    architecture or key)."""
    return translate.from_hf_items(_known(model_type), key, tensor)
