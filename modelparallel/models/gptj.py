"""GPT-J (``GPTJModel``, ``GPTJForCausalLM``...): plan as data.

Each block runs attention and MLP in parallel off one LayerNorm; both are Megatron column/row
pairs. q, k and v are separate ``nn.Linear`` layers whose outputs are whole heads when sharded
by rows, and the rotary embedding is applied per head (to its first ``rotary_dim`` features),
so a rank's heads rotate exactly as in the full model. ``GPTJAttention`` reshapes with
``num_attention_heads`` (``head_dim`` stays), so that one becomes per rank; ``embed_dim`` is
only read in ``__init__``. The LM head is untied and has a bias, sharded with its rows.
"""

from ..tp.plan import ArchSpec, ModulePlan, SharedInput

SPEC = ArchSpec(
    model_type="gptj",
    base=ModulePlan(
        rules={
            "wte": "vocab_embedding",
            "h.*.attn.q_proj": "colwise",
            "h.*.attn.k_proj": "colwise",
            "h.*.attn.v_proj": "colwise",
            "h.*.attn.out_proj": "rowwise",
            "h.*.mlp.fc_in": "colwise",
            "h.*.mlp.fc_out": "rowwise",
        },
        per_rank_attrs={"h.*.attn": ("num_attention_heads",)},
        shared_inputs={"h.*": SharedInput(output_of="ln_1")},  # q, k, v and fc_in read ln_1's output
    ),
    head=ModulePlan(rules={"lm_head": "vocab_colwise"}, optional_rules=("lm_head",)),
    divisible_config=("num_attention_heads",),
)
