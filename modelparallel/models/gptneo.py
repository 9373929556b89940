"""GPT-Neo (``GPTNeoModel``, ``GPTNeoForCausalLM``...).

Layers alternate global and local (sliding-window) attention; both are ``GPTNeoSelfAttention``
at ``h.*.attn.attention`` and differ only in the causal ``bias`` buffer, a [1, 1, positions,
positions] boolean mask with no head dimension, so it stays whole on every rank. Attention is
unscaled in HF and stays so. The module reshapes with ``num_heads`` (``head_dim`` stays), which
becomes per rank. The LM head is tied to ``wte``; both are sharded over the vocabulary. No weight
is fused. Older HF checkpoints stored per-layer masks: the causal mask for global layers and, for
local layers, the causal mask restricted to a window.
"""

import torch

from ..nn.huggingface.translate import KeyTable, causal_mask, masked_bias
from ..tp.plan import LM_HEAD, ArchSpec, ModulePlan, column_row

SPEC = ArchSpec(
    model_type="gpt_neo",
    base=ModulePlan(
        rules={
            "wte": "vocab_embedding",
            **column_row("h.*.attn.attention", ("q_proj", "k_proj", "v_proj"), "out_proj"),
            **column_row("h.*.mlp", ("c_fc",), "c_proj"),
        },
        per_rank_attrs={"h.*.attn.attention": ("num_heads",)},
    ),
    head=LM_HEAD,
    divisible_config=("num_heads",),
    loss="causal",
)


def legacy_mask(max_seq_len: int, layer: int, config=None) -> torch.Tensor:
    """The mask an older checkpoint stored for ``layer``: windowed for local layers when the model
    ``config`` says which layers are local; without a config, the global causal mask."""
    mask = causal_mask(max_seq_len, layer)
    if config is not None and config.attention_layers[layer] == "local":
        mask = torch.bitwise_xor(mask, torch.tril(mask, -config.window_size))
    return mask


TABLE = KeyTable(
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
    legacy_buffers={"h.{}.attn.attention.bias": legacy_mask, "h.{}.attn.attention.masked_bias": masked_bias(-1e9)},
)
