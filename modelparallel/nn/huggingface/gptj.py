"""GPT-J state-dict translation. Older HF checkpoints stored a causal mask and masked bias per
layer; current ones keep only weights (the rotary table ``embed_positions`` is recomputed)."""

from .translate import KeyTable, causal_mask, from_hf, masked_bias, to_hf

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


def translate_state_dict_to_hf_gptj(state_dict, max_seq_len=None, legacy_buffers=False):
    """Distributed-format GPT-J state dict -> HF GPT-J state dict."""
    return to_hf(TABLE, state_dict, max_seq_len, legacy_buffers)


def translate_hf_state_dict_to_smdistributed_gptj(state_dict):
    """HF GPT-J state dict -> distributed format."""
    return from_hf(TABLE, state_dict)


translate_hf_gptj_state_dict_to_smdistributed_gptj = translate_hf_state_dict_to_smdistributed_gptj


def translate_hf_gptj_state_dict_to_smdistributed(state_dict, max_seq_len=None):
    """SageMaker's other spelling: HF GPT-J -> distributed format. ``max_seq_len`` is accepted
    for the older two-argument call and has no effect (no mask buffer is imported)."""
    return from_hf(TABLE, state_dict)
