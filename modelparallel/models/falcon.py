"""Falcon (``FalconModel``, ``FalconForCausalLM``...): Falcon-40B/180B, Falcon-11B, RefinedWeb.

``query_key_value`` fuses q, k and v; its rows come in whole units of a column shard either way
Falcon lays them out: per KV group (``new_decoder_architecture``: [KV heads, heads per KV head + 2,
head_dim], the group's queries then its key and value) or per head (multi-head: [heads, 3,
head_dim]). A contiguous column shard is then whole groups (or heads), and the degree must divide
``num_kv_heads`` (which equals the heads for multi-head models). ``FalconAttention`` reshapes with
``num_heads`` and ``num_kv_heads``, which become per rank. Blocks run attention and MLP in
parallel off one or two LayerNorms (``parallel_attn``, ``num_ln_in_parallel_attn``) or in
sequence: two Megatron pairs in every case, each column layer summing its own input gradient.
``FalconLinear`` is an ``nn.Linear``. The LM head is tied by default.

Refused at TP > 1, naming the feature: ALiBi (``alibi``: the bias tensor is built for all heads
at once in the base model) and multi-query attention of the original layout (``multi_query``
without ``new_decoder_architecture``: one KV head stored after all queries).
"""

from dataclasses import replace

from ._translate import KeyTable
from ..tp.plan import Unsupported
from ._architecture import Architecture
from ._parts import decoder_lm

SPEC = decoder_lm(
    "falcon", embedding="word_embeddings",
    attention="h.*.self_attention", qkv=("query_key_value",), out="dense",
    mlp="h.*.mlp", up=("dense_h_to_4h",), down="dense_4h_to_h",
    divisible=("num_attention_heads", "num_kv_heads"), per_rank=("num_heads", "num_kv_heads"),
)
SPEC = replace(SPEC, unsupported=(
    Unsupported("ALiBi position biases", when={"alibi": True}),
    Unsupported("multi-query attention with the queries, key and value fused one after another",
                when={"multi_query": True, "new_decoder_architecture": False}),
))

_LAYER = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h",
          "input_layernorm", "post_attention_layernorm", "ln_attn", "ln_mlp")

TABLE = KeyTable(
    arch="falcon",
    base_prefix="transformer",
    base_keys=("word_embeddings.weight", "ln_f.weight", "ln_f.bias",
               *(f"h.{{}}.{m}.{p}" for m in _LAYER for p in ("weight", "bias"))),
    head_keys=("lm_head.weight", "score.weight", "score.bias"),
    tied={"lm_head.weight": "transformer.word_embeddings.weight"},
)

ARCHITECTURE = Architecture(SPEC, TABLE)
