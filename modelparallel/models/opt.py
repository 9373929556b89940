"""OPT (``OPTModel``, ``OPTForCausalLM``...): Meta's OPT-125m ... OPT-66B.

The decoder sits under ``model.decoder``. Attention's q, k and v (with biases) are column
parallel, ``out_proj`` row parallel; ``OPTAttention`` reshapes with ``num_heads``, which becomes
per rank. The feed-forward is ``fc1`` / ``fc2`` directly in the layer (no MLP module): one more
Megatron pair. Learned position embeddings (offset by 2), the LayerNorms (before or after each
sub-block, ``do_layer_norm_before``) and OPT-350m's ``project_in`` / ``project_out`` (between the
embedding width and the hidden size) stay whole. The LM head is tied to ``embed_tokens``. No
weight is fused.
"""

from ._translate import KeyTable
from ..tp.plan import SharedInput
from ._architecture import Architecture
from ._parts import decoder_lm

SPEC = decoder_lm(
    "opt", embedding="decoder.embed_tokens",
    attention="decoder.layers.*.self_attn", qkv=("q_proj", "k_proj", "v_proj"), out="out_proj",
    mlp="decoder.layers.*", up=("fc1",), down="fc2",
    divisible=("num_attention_heads",), per_rank=("num_heads",),
    shared_inputs={"decoder.layers.*.self_attn": SharedInput(arg="hidden_states")},  # q, k, v
)

_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "self_attn_layer_norm",
          "fc1", "fc2", "final_layer_norm")

TABLE = KeyTable(
    arch="opt",
    base_prefix="model",
    base_keys=("decoder.embed_tokens.weight", "decoder.embed_positions.weight", "decoder.project_in.weight",
               "decoder.project_out.weight", "decoder.final_layer_norm.weight", "decoder.final_layer_norm.bias",
               *(f"decoder.layers.{{}}.{m}.{p}" for m in _LAYER for p in ("weight", "bias"))),
    head_keys=("lm_head.weight", "score.weight"),
    tied={"lm_head.weight": "model.decoder.embed_tokens.weight"},
)

ARCHITECTURE = Architecture(SPEC, TABLE)
