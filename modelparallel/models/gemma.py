"""Gemma (``GemmaModel``, ``GemmaForCausalLM``...): Llama's module tree and key names.

Gemma's word embedding is HF's ``GemmaTextScaledWordEmbedding``, an ``nn.Embedding`` subclass
multiplying the lookup by ``sqrt(hidden_size)``: the vocabulary-parallel style keeps that subclass
(its forward calls the sharded lookup as ``super().forward``), so the scale applies on every
rank after the sum. RMSNorms scale by ``1 + weight`` and stay whole. The LM head is tied to the
embeddings by default. Grouped-query (and multi-query, Gemma-2B's one KV head) attention as
Llama's: whole query heads per rank, KV heads whole or replicated. No weight is fused.
"""

from dataclasses import replace

from . import llama
from ._architecture import Architecture

SPEC = replace(llama.SPEC, model_type="gemma")
TABLE = replace(llama.TABLE, arch="gemma")

ARCHITECTURE = Architecture(SPEC, TABLE)
