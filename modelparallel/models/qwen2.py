"""Qwen2 (``Qwen2Model``, ``Qwen2ForCausalLM``...): Llama's module tree and key names.

Qwen2 differs from Llama in biases on q, k and v only (``o_proj`` and the MLP have none), which
shard with their rows, and in sliding-window layers (``layer_types``), which HF applies through
the attention mask. Grouped-query attention as Llama's: whole query heads and whole key/value
heads per rank. No weight is fused.
"""

from dataclasses import replace

from . import llama
from ._architecture import Architecture

SPEC = replace(llama.SPEC, model_type="qwen2")
TABLE = replace(llama.TABLE, arch="qwen2")

ARCHITECTURE = Architecture(SPEC, TABLE)
