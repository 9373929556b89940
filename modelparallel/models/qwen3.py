"""Qwen3 (``Qwen3Model``, ``Qwen3ForCausalLM``...): Llama's module tree plus per-head norms.

``q_norm`` and ``k_norm`` are RMSNorms over ``head_dim``, applied to every head alike after the
projections: whole heads per rank make them replicated modules that see only their rank's heads,
so they stay whole, but each rank's gradient of their weight covers only its own heads: the
``replicated_grad_sum`` style sums it over the ranks (the gradient one process computes over all
heads). The rest is Llama's plan: grouped-query attention, no fused weight.
"""

from dataclasses import replace

from . import llama
from ._architecture import Architecture

SPEC = replace(llama.SPEC, model_type="qwen3", base=replace(llama.SPEC.base, rules={
    **llama.SPEC.base.rules,
    "layers.*.self_attn.q_norm": "replicated_grad_sum", "layers.*.self_attn.k_norm": "replicated_grad_sum"}))
TABLE = replace(llama.TABLE, arch="qwen3",
                base_keys=(*llama.TABLE.base_keys, "layers.{}.self_attn.q_norm.weight",
                           "layers.{}.self_attn.k_norm.weight"))

ARCHITECTURE = Architecture(SPEC, TABLE)
