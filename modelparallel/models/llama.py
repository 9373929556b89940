"""Llama (``LlamaModel``, ``LlamaForCausalLM``...), including grouped-query attention.

q, k and v are column parallel, so each rank holds whole query heads and whole key/value heads;
with ``num_key_value_heads`` < ``num_attention_heads`` a rank's query heads are exactly those
that share its key/value heads when the degree divides both (HF groups consecutive query heads
per KV head, and both are split in order). ``LlamaAttention`` reshapes with ``-1`` heads and
``head_dim``, and ``num_key_value_groups`` (heads per KV head) is then the same on every rank.
When the degree does not divide the KV heads (8 KV heads at TP 16, 2 at TP 4), the ``KVHeads``
rule replicates them: ``k_proj`` / ``v_proj`` stay whole and each rank computes the KV heads its
query heads read (``tp/replicated.py``). Whether to must come from the config: ``k_proj``'s width
(KV heads x head_dim) can be divisible when the KV heads are not. The rotary embedding lives in
the base model, per head, and stays whole. The LM head may be tied to ``embed_tokens`` or not.
No weight is fused. The distributed state dict is HF's: rotary ``inv_freq`` is a non-persistent
buffer the model recomputes, so nothing else is stored.
"""

from ..context.spec import ContextSpec
from ._translate import KeyTable
from ..pipeline.split import PipelineSplit
from ..tp.plan import KVHeads, SharedInput
from ._architecture import Architecture
from ._parts import decoder_lm

SPEC = decoder_lm(
    "llama", embedding="embed_tokens",
    attention="layers.*.self_attn", qkv=("q_proj", "k_proj", "v_proj"), out="o_proj",
    mlp="layers.*.mlp", up=("gate_proj", "up_proj"), down="down_proj",
    divisible=("num_attention_heads",),
    shared_inputs={"layers.*.self_attn": SharedInput(arg="hidden_states"),  # q, k, v
                   "layers.*.mlp": SharedInput(arg="x")},  # gate, up
    kv_heads={"layers.*.self_attn": KVHeads()},
)

PIPELINE = PipelineSplit(blocks="layers", first=("embed_tokens",), last=("norm",))
"""The rotary table holds no parameters and stays on every stage."""
CONTEXT = ContextSpec(attention="layers.*.self_attn")  # HF's attention interface

TABLE = KeyTable(
    arch="llama",
    base_prefix="model",
    base_keys=(
        "embed_tokens.weight", "norm.weight",
        "layers.{}.input_layernorm.weight", "layers.{}.post_attention_layernorm.weight",
        "layers.{}.self_attn.q_proj.weight", "layers.{}.self_attn.k_proj.weight",
        "layers.{}.self_attn.v_proj.weight", "layers.{}.self_attn.o_proj.weight",
        "layers.{}.self_attn.q_proj.bias", "layers.{}.self_attn.k_proj.bias",
        "layers.{}.self_attn.v_proj.bias", "layers.{}.self_attn.o_proj.bias",
        "layers.{}.mlp.gate_proj.weight", "layers.{}.mlp.up_proj.weight", "layers.{}.mlp.down_proj.weight",
    ),
    head_keys=("lm_head.weight", "score.weight"),
    tied={"lm_head.weight": "model.embed_tokens.weight"},
)

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, context=CONTEXT)
