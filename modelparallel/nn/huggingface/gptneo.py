"""GPT-Neo state-dict translation. Older HF checkpoints stored per-layer attention masks: the
causal mask for global layers and, for local layers, the causal mask restricted to a window."""

import torch

from .translate import KeyTable, causal_mask, from_hf, masked_bias, to_hf


def _mask_for(config):
    """A legacy-mask builder that knows which layers are local and their window (from ``config``);
    without a config every layer gets the global causal mask."""
    if config is None:
        return causal_mask
    def build(max_seq_len, layer):
        mask = causal_mask(max_seq_len, layer)
        if config.attention_layers[layer] == "local":
            mask = torch.bitwise_xor(mask, torch.tril(mask, -config.window_size))
        return mask
    return build


def _table(config=None):
    return KeyTable(
        arch="gpt_neo",
        base_prefix="transformer",
        base_keys=(
            "wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias",
            "h.{}.ln_1.weight", "h.{}.ln_1.bias", "h.{}.ln_2.weight", "h.{}.ln_2.bias",
            "h.{}.attn.attention.q_proj.weight", "h.{}.attn.attention.k_proj.weight",
            "h.{}.attn.attention.v_proj.weight", "h.{}.attn.attention.out_proj.weight",
            "h.{}.attn.attention.out_proj.bias",
            "h.{}.mlp.c_fc.weight", "h.{}.mlp.c_fc.bias", "h.{}.mlp.c_proj.weight", "h.{}.mlp.c_proj.bias",
        ),
        head_keys=("lm_head.weight", "score.weight", "score.bias"),
        tied={"lm_head.weight": "transformer.wte.weight"},
        legacy_buffers={"h.{}.attn.attention.bias": _mask_for(config),
                        "h.{}.attn.attention.masked_bias": masked_bias(-1e9)},
    )


TABLE = _table()


def translate_state_dict_to_hf_gptneo(state_dict, max_seq_len=None, config=None, legacy_buffers=False):
    """Distributed-format GPT-Neo state dict -> HF. Give the model ``config`` with
    ``max_seq_len`` to get the windowed masks of local-attention layers right."""
    return to_hf(_table(config), state_dict, max_seq_len, legacy_buffers)


def translate_hf_state_dict_to_smdistributed_gptneo(state_dict):
    """HF GPT-Neo state dict -> distributed format."""
    return from_hf(TABLE, state_dict)
