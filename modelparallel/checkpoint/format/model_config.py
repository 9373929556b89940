"""The model configuration a checkpoint records, and what must match when it is loaded.

Shapes alone do not identify a model: GPT-2 with ``n_embd=32`` and 2 heads has exactly the
tensors of the same model with 4 heads, and loading one into the other gives a model that runs
and computes something else. So a checkpoint records the structural entries of the model's
Hugging Face config (head and layer counts, sizes, activation, positions, norms, rotary
settings: names matched by ``_STRUCTURAL``; dropout and run-time options are not compared) and
a load compares those present on both sides.
"""

from __future__ import annotations

import json
import re
from typing import Any

_STRUCTURAL = re.compile(r"head|layer|hidden|embd|inner|intermediate|position|vocab|act|rope|rotary|window|"
                         r"expert|eps|epsilon|scale_attn|kv_|ffn|dim|n_ctx|alibi|parallel_residual")
_IGNORED = re.compile(r"drop|token_id|label|output_|return_dict|use_cache|dtype|torchscript|_name_or_path|"
                      r"architectures|transformers_version|tokenizer|problem_type|chunk_size|summary_|^_")


def _plain(value: Any) -> Any:
    """``value`` as JSON would give it back, or None if JSON cannot hold it."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


def structural(config) -> dict[str, Any]:
    """The structural entries of an HF config (empty for a model without one)."""
    if config is None or not hasattr(config, "to_dict"):
        return {}
    out = {}
    for key, value in config.to_dict().items():
        if _STRUCTURAL.search(key) and not _IGNORED.search(key) and (plain := _plain(value)) is not None:
            out[key] = plain
    return out


def differences(saved: dict | None, config) -> list[str]:
    """``"config KEY: checkpoint A, model B"`` for every structural entry both record differently."""
    if not isinstance(saved, dict):
        return []
    mine = structural(config)
    return [f"config {k}: checkpoint {saved[k]!r}, model {mine[k]!r}"
            for k in sorted(set(saved) & set(mine)) if saved[k] != mine[k]]
