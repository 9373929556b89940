"""Mistral (``MistralModel``, ``MistralForCausalLM``...): Llama's module tree and key names.

Mistral differs from Llama only in attention's sliding window, which HF applies through the
attention mask and the ``sliding_window`` argument, never through a parameter or a per-head
size: the same plan (q, k, v column parallel with whole query and key/value heads per rank,
o_proj row parallel, the gated MLP likewise, vocab-parallel embeddings and LM head), the same
head-count checks, the same state-dict keys under ``model``. No weight is fused.
"""

from dataclasses import replace

from . import llama
from ._architecture import Architecture

SPEC = replace(llama.SPEC, model_type="mistral")
TABLE = replace(llama.TABLE, arch="mistral")
PIPELINE = llama.PIPELINE
CONTEXT = llama.CONTEXT  # HF's attention interface passes the sliding window itself

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, context=CONTEXT)
