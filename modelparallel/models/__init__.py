"""Built-in architectures: HF ``config.model_type`` -> ``ArchSpec`` (each in its own small file)."""

from __future__ import annotations

from torch import nn

from ..tp.plan import ArchSpec
from . import bert, gpt2, gptj, gptneo, llama, roberta

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (gpt2.SPEC, bert.SPEC, roberta.SPEC, gptj.SPEC, gptneo.SPEC, llama.SPEC)
    if spec is not None
}


def spec_for(model: nn.Module) -> ArchSpec | None:
    """The built-in spec for an HF model, or None if its architecture has none."""
    return ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None))
