"""Llama (``LlamaModel``, ``LlamaForCausalLM``...), including grouped-query attention: plan as data.

q, k and v are column parallel, so each rank holds whole query heads and whole key/value heads;
with ``num_key_value_heads`` < ``num_attention_heads`` the degree must divide both, and then a
rank's query heads are exactly those that share its key/value heads (HF groups consecutive query
heads per KV head, and both are split in order). ``LlamaAttention`` reshapes with ``-1`` heads and
``head_dim``, and ``num_key_value_groups`` (heads per KV head) is the same on every rank, so no
attribute needs rewriting. The KV-head check must come from the config: ``k_proj``'s width
(KV heads x head_dim) can be divisible when the KV heads are not. The rotary embedding lives in
the base model, per head, and stays whole. The LM head may be tied to ``embed_tokens`` or not.
"""

from ..tp.plan import ArchSpec, ModulePlan, SharedInput

SPEC = ArchSpec(
    model_type="llama",
    base=ModulePlan(
        rules={
            "embed_tokens": "vocab_embedding",
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise",
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
        },
        shared_inputs={"layers.*.self_attn": SharedInput(arg="hidden_states"),  # q, k, v
                       "layers.*.mlp": SharedInput(arg="x")},  # gate, up
    ),
    head=ModulePlan(rules={"lm_head": "vocab_colwise"}, optional_rules=("lm_head",)),
    divisible_config=("num_attention_heads", "num_key_value_heads"),
)
