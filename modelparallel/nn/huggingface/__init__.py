"""Hugging Face state-dict translation, per architecture, with SageMaker's function names.

``to_hf_items`` / ``from_hf_items`` translate one entry at a time (for streaming exports);
``TABLES`` maps an HF ``model_type`` to its key table.
"""

from __future__ import annotations

import torch

from . import bert, gpt2, gptj, gptneo, llama, roberta
from . import translate as _t

TABLES: dict[str, _t.KeyTable] = {m.TABLE.arch: m.TABLE for m in (gpt2, bert, roberta, gptj, gptneo, llama)}


def table_for(model_type: str) -> _t.KeyTable | None:
    """The key table of an HF ``model_type``, or None if it has no translation."""
    return TABLES.get(model_type)


def to_hf_items(model_type: str, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One distributed-format entry of a ``model_type`` model as HF entries."""
    return _t.to_hf_items(TABLES[model_type], key, tensor)


def from_hf_items(model_type: str, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One HF entry of a ``model_type`` model in distributed format."""
    return _t.from_hf_items(TABLES[model_type], key, tensor)
