"""GPT-2 state-dict translation (SageMaker's ``smdistributed.modelparallel.torch.nn.huggingface.gpt2``).

HF's ``c_attn`` is a ``Conv1D`` ([in, out] weight) with q|k|v concatenated along the output; the
distributed format keeps the three as a separate dimension ([in, 3, out/3]), the layout the
tensor-parallel plan shards per head. Older HF checkpoints also stored a causal mask and a masked
bias per layer; they are dropped on import and re-created on export when ``max_seq_len`` is given.
"""

from .translate import KeyTable, causal_mask, from_hf, masked_bias, to_hf

TABLE = KeyTable(
    arch="gpt2",
    base_prefix="transformer",
    base_keys=(
        "wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias",
        "h.{}.ln_1.weight", "h.{}.ln_1.bias", "h.{}.ln_2.weight", "h.{}.ln_2.bias",
        "h.{}.attn.c_attn.weight", "h.{}.attn.c_attn.bias", "h.{}.attn.c_proj.weight", "h.{}.attn.c_proj.bias",
        "h.{}.mlp.c_fc.weight", "h.{}.mlp.c_fc.bias", "h.{}.mlp.c_proj.weight", "h.{}.mlp.c_proj.bias",
    ),
    head_keys=("lm_head.weight", "score.weight", "score.bias"),
    packed={"h.{}.attn.c_attn.weight": (1, 3), "h.{}.attn.c_attn.bias": (0, 3)},
    tied={"lm_head.weight": "transformer.wte.weight"},
    legacy_buffers={"h.{}.attn.bias": causal_mask, "h.{}.attn.masked_bias": masked_bias(-1e4)},
)


def translate_state_dict_to_hf_gpt2(state_dict, max_seq_len=None, legacy_buffers=False):
    """Distributed-format state dict (``DistributedModel.state_dict()``) -> HF GPT-2 state dict."""
    return to_hf(TABLE, state_dict, max_seq_len, legacy_buffers)


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict):
    """HF GPT-2 state dict -> distributed format, for ``DistributedModel.load_state_dict``."""
    return from_hf(TABLE, state_dict)
