"""Phi-3 (``Phi3Model``, ``Phi3ForCausalLM``...): Phi-3 and Phi-3.5 mini, Phi-4-mini's family.

Two fused projections. ``qkv_proj`` holds q | k | v one after another ([q heads | KV heads | KV
heads] x head_dim rows) and ``gate_up_proj`` gate | up: both are packed, sharded inside each
chunk, so a rank's output is [its q | its k | its v] and [its gate | its up], stored with the
chunk as its own dimension ([chunks, rows / chunks, in]: independent of the degree). The
attention slices its fused output at ``self.config.num_attention_heads * head_dim`` and
``self.num_key_value_heads * head_dim``: both become per rank (the config through the module's
own view of it, ``tp/per_rank.py``). Partial rotary (``partial_rotary_factor``) rotates the first
features of every head, on every rank alike. The LM head is untied by default.

Refused at TP > 1: grouped-query attention (``num_key_value_heads`` below
``num_attention_heads``), whose fused chunks differ in size.
"""

from ._translate import KeyTable
from ..tp.plan import ArchSpec, ModulePlan, Packed, SharedInput, Unsupported, packed_keys
from ._architecture import Architecture
from ._parts import LM_HEAD

PACKED = {"layers.*.self_attn.qkv_proj": Packed(chunks=3, dims={"weight": 0, "bias": 0}),
          "layers.*.mlp.gate_up_proj": Packed(chunks=2, dims={"weight": 0, "bias": 0})}

SPEC = ArchSpec(
    model_type="phi3",
    base=ModulePlan(
        rules={"embed_tokens": "vocab_embedding",
               "layers.*.self_attn.qkv_proj": "packed_colwise", "layers.*.self_attn.o_proj": "rowwise",
               "layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise"},
        packed=PACKED,
        per_rank_attrs={"layers.*.self_attn": ("config.num_attention_heads", "num_key_value_heads")},
        # the attention views its fused output with its input's [batch, seq]: under sequence
        # parallelism it gathers at its entry
        shared_inputs={"layers.*.self_attn": SharedInput(arg="hidden_states")},
    ),
    head=LM_HEAD,
    divisible_config=("num_attention_heads", "num_key_value_heads"),
    loss="causal",
    unsupported=(Unsupported("grouped-query attention in a fused qkv_proj (chunks of unequal sizes)",
                             differ=("num_attention_heads", "num_key_value_heads")),),
)

TABLE = KeyTable(
    arch="phi3",
    base_prefix="model",
    base_keys=("embed_tokens.weight", "norm.weight", "layers.{}.input_layernorm.weight",
               "layers.{}.post_attention_layernorm.weight", "layers.{}.self_attn.qkv_proj.weight",
               "layers.{}.self_attn.o_proj.weight", "layers.{}.mlp.gate_up_proj.weight",
               "layers.{}.mlp.down_proj.weight"),
    head_keys=("lm_head.weight", "score.weight"),
    packed=packed_keys(PACKED),
    tied={"lm_head.weight": "model.embed_tokens.weight"},
)

ARCHITECTURE = Architecture(SPEC, TABLE)
