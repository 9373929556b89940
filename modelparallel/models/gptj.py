"""GPT-J (``GPTJModel``, ``GPTJForCausalLM``...).

Each block runs attention and MLP in parallel off one LayerNorm; both are Megatron column/row
pairs. q, k and v are separate ``nn.Linear`` layers whose outputs are whole heads when sharded
by rows, and the rotary embedding is applied per head (to its first ``rotary_dim`` features),
so a rank's heads rotate exactly as in the full model. ``GPTJAttention`` reshapes with
``num_attention_heads`` (``head_dim`` stays), so that one becomes per rank; ``embed_dim`` is
only read in ``__init__``. The LM head is untied and has a bias, sharded with its rows. No weight
is fused. Older HF checkpoints stored a causal mask and masked bias per layer; current ones keep
only weights (the rotary table ``embed_positions`` is recomputed).
"""

from ..nn.huggingface.translate import KeyTable, causal_mask, masked_bias
from ..tp.plan import LM_HEAD, ArchSpec, ModulePlan, column_row

SPEC = ArchSpec(
    model_type="gptj",
    base=ModulePlan(
        rules={
            "wte": "vocab_embedding",
            **column_row("h.*.attn", ("q_proj", "k_proj", "v_proj"), "out_proj"),
            **column_row("h.*.mlp", ("fc_in",), "fc_out"),
        },
        per_rank_attrs={"h.*.attn": ("num_attention_heads",)},
    ),
    head=LM_HEAD,
    divisible_config=("num_attention_heads",),
    loss="causal",
)

TABLE = KeyTable(
    arch="gptj",
    base_prefix="transformer",
    base_keys=(
        "wte.weight", "ln_f.weight", "ln_f.bias", "h.{}.ln_1.weight", "h.{}.ln_1.bias",
        "h.{}.attn.q_proj.weight", "h.{}.attn.k_proj.weight", "h.{}.attn.v_proj.weight",
        "h.{}.attn.out_proj.weight", "h.{}.mlp.fc_in.weight", "h.{}.mlp.fc_in.bias",
        "h.{}.mlp.fc_out.weight", "h.{}.mlp.fc_out.bias",
    ),
    head_keys=("lm_head.weight", "lm_head.bias", "score.weight"),
    legacy_buffers={"h.{}.attn.bias": causal_mask, "h.{}.attn.masked_bias": masked_bias(-1e9)},
)
