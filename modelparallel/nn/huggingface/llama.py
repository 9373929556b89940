"""Llama state-dict translation. The distributed format is HF's: rotary ``inv_freq`` is a
non-persistent buffer the model recomputes, so nothing else is stored."""

from .translate import KeyTable, from_hf, to_hf

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


def translate_state_dict_to_hf_llama(state_dict, max_seq_len=None, legacy_buffers=False):
    """Distributed-format Llama state dict -> HF (``max_seq_len`` accepted for symmetry; Llama
    checkpoints never stored masks)."""
    return to_hf(TABLE, state_dict, max_seq_len, legacy_buffers)


def translate_hf_state_dict_to_smdistributed_llama(state_dict):
    """HF Llama state dict -> distributed format."""
    return from_hf(TABLE, state_dict)
