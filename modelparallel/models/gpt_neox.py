"""GPT-NeoX (``GPTNeoXModel``, ``GPTNeoXForCausalLM``...): Pythia, GPT-NeoX-20B and their kin.

``query_key_value`` fuses q, k and v per head: its output is read as [heads, 3 x head_size]
(``view(..., -1, 3 * head_size)`` then ``chunk(3)``), so rows come head by head, each head's q, k
and v together. A contiguous column shard is therefore whole heads with their own q, k and v:
plain column parallel, no packing, and the degree must divide the heads. The module reshapes
with ``-1`` heads, so no attribute is rewritten. Partial rotary (``rotary_pct``) rotates the
first features of every head, on every rank alike. ``use_parallel_residual`` blocks run
attention and MLP off two LayerNorms of the same input: two Megatron pairs either way. The LM
head is untied by default (``tie_word_embeddings`` ties it); HF stores it as ``embed_out.weight``
and renames it to ``lm_head`` on load, so exports write that name and imports take both.
"""

from ..tp.plan import SharedInput
from ._architecture import Architecture
from ._translate import KeyTable
from ._parts import decoder_lm

SPEC = decoder_lm(
    "gpt_neox", embedding="embed_in",
    attention="layers.*.attention", qkv=("query_key_value",), out="dense",
    mlp="layers.*.mlp", up=("dense_h_to_4h",), down="dense_4h_to_h",
    divisible=("num_attention_heads",),
    # the attention reshapes with its input's [batch, seq]: under sequence parallelism it gathers at its entry
    shared_inputs={"layers.*.attention": SharedInput(arg="hidden_states")},
)

_LAYER = ("input_layernorm", "post_attention_layernorm", "attention.query_key_value", "attention.dense",
          "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")

TABLE = KeyTable(
    arch="gpt_neox",
    base_prefix="gpt_neox",
    base_keys=("embed_in.weight", "final_layer_norm.weight", "final_layer_norm.bias",
               *(f"layers.{{}}.{m}.{p}" for m in _LAYER for p in ("weight", "bias"))),
    head_keys=("lm_head.weight", "score.weight", "score.bias"),
    tied={"lm_head.weight": "gpt_neox.embed_in.weight"},
    stored_as={"lm_head.weight": "embed_out.weight"},
)

ARCHITECTURE = Architecture(SPEC, TABLE)
