"""GPT-2 (``GPT2Model``, ``GPT2LMHeadModel``, ``GPT2ForSequenceClassification``...): plan as data.

HF's ``Conv1D`` stores weights as [in, out]; the styles pick the right dimension from the module
type. ``c_attn`` fuses q|k|v along its output, so it is packed in 3 chunks and each rank gets its
own heads of all three. The attention module reshapes with ``num_heads``, ``split_size`` and
``embed_dim``, which become per-rank values. ``wte`` is vocab-parallel and the LM head, tied to it,
keeps its logits vocab-sharded for the loss.
"""

from ..tp.plan import ArchSpec, ModulePlan

SPEC = ArchSpec(
    model_type="gpt2",
    base=ModulePlan(
        rules={
            "wte": "vocab_embedding",
            "h.*.attn.c_attn": "packed_colwise",
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        packed={"h.*.attn.c_attn": 3},
        per_rank_attrs={"h.*.attn": ("num_heads", "split_size", "embed_dim")},
    ),
    head=ModulePlan(rules={"lm_head": "vocab_colwise"}, optional_rules=("lm_head",)),
)
