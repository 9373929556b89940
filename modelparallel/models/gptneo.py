"""GPT-Neo (``GPTNeoModel``, ``GPTNeoForCausalLM``...): plan as data.

Layers alternate global and local (sliding-window) attention; both are ``GPTNeoSelfAttention``
at ``h.*.attn.attention`` and differ only in the causal ``bias`` buffer, a [1, 1, positions,
positions] boolean mask with no head dimension, so it stays whole on every rank. Attention is
unscaled in HF and stays so. The module reshapes with ``num_heads`` (``head_dim`` stays), which
becomes per rank. The LM head is tied to ``wte``; both are sharded over the vocabulary.
"""

from ..tp.plan import ArchSpec, ModulePlan, SharedInput

SPEC = ArchSpec(
    model_type="gpt_neo",
    base=ModulePlan(
        rules={
            "wte": "vocab_embedding",
            "h.*.attn.attention.q_proj": "colwise",
            "h.*.attn.attention.k_proj": "colwise",
            "h.*.attn.attention.v_proj": "colwise",
            "h.*.attn.attention.out_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        per_rank_attrs={"h.*.attn.attention": ("num_heads",)},
        shared_inputs={"h.*.attn.attention": SharedInput(arg="hidden_states")},  # q, k, v
    ),
    head=ModulePlan(rules={"lm_head": "vocab_colwise"}, optional_rules=("lm_head",)),
    divisible_config=("num_heads",),
)
