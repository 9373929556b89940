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

from ..context.spec import ContextSpec
from ._translate import KeyTable, causal_mask, masked_bias
from ..pipeline.split import PipelineSplit
from ..tp.plan import SharedInput
from ._architecture import Architecture
from ._parts import decoder_lm
from ._sagemaker import SageMakerLayout
from .gpt2 import GPT_KEYS

SPEC = decoder_lm(
    "gpt_neo", embedding="wte",
    attention="h.*.attn.attention", qkv=("q_proj", "k_proj", "v_proj"), out="out_proj",
    mlp="h.*.mlp", up=("c_fc",), down="c_proj",
    divisible=("num_heads",), per_rank=("num_heads",),
    shared_inputs={"h.*.attn.attention": SharedInput(arg="hidden_states")},  # q, k, v
)

PIPELINE = PipelineSplit(blocks="h", first=("wte", "wpe"), last=("ln_f",))


CONTEXT = ContextSpec(  # GPTNeoSelfAttention._attn: unscaled; local layers see the last window_size tokens
    attention="h.*.attn.attention", method="_attn", scale=lambda attn: 1.0,
    window=lambda attn: attn.config.window_size if attn.attention_type == "local" else None,
    dropout=lambda attn: attn.attn_dropout.p)


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
        *GPT_KEYS,
        "h.{}.attn.attention.q_proj.weight", "h.{}.attn.attention.k_proj.weight",
        "h.{}.attn.attention.v_proj.weight", "h.{}.attn.attention.out_proj.weight",
        "h.{}.attn.attention.out_proj.bias",
    ),
    head_keys=("lm_head.weight", "score.weight", "score.bias"),
    tied={"lm_head.weight": "transformer.wte.weight"},
    legacy_buffers={"h.{}.attn.attention.bias": legacy_mask, "h.{}.attn.attention.masked_bias": masked_bias(-1e9)},
)

SAGEMAKER = SageMakerLayout(layers="h", attention="attn", output="mlp", scores_in_fp32=True)
"""SageMaker's tree over ``h.N.attn`` / ``h.N.mlp``; ``GPTNeoSelfAttention._attn`` scores in float32."""

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, context=CONTEXT, sagemaker=SAGEMAKER)
