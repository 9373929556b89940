"""``query_key_layer_scaling`` (SageMaker's ``model_creation`` option, Megatron-LM's
``apply_query_key_layer_scaling``): attention scores of layer L computed in fp16 as
``q k^T / (sqrt(d) L)``, then taken to fp32 and multiplied back by L before the softmax.

Mathematically the scores are unchanged; the point is that deep layers' fp16 scores stay far
from fp16's overflow. So the option changes nothing unless attention runs in float16: in any
other dtype the model's own attention runs, bit for bit, and architectures whose HF attention
already scores in float32 (GPT-J, GPT-Neo) need nothing. Elsewhere the model switches to an
attention implementation registered with HF's ``AttentionInterface`` under the name
``modelparallel_qk_layer_scaling_<base>``, which wraps the implementation it had (``sdpa`` or
``eager``), masks included.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "modelparallel_qk_layer_scaling_"
BASES = ("eager", "sdpa")
"""Implementations the scaling can wrap (their masks and fp32 paths are HF's own)."""


def _base_attention(module: nn.Module, base: str):
    """What the model would call without the option: ``sdpa`` from HF's registry, ``eager``
    from the model's own modeling file (each file has its own ``eager_attention_forward``)."""
    if base != "eager":
        return ALL_ATTENTION_FUNCTIONS[base]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(f"query_key_layer_scaling: {type(module).__name__}'s modeling file has no "
                                  "eager_attention_forward to wrap")
    return eager


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """fp32 ``scores`` [N, H, q, k] with the mask applied: HF's additive float mask, its boolean
    one (True = attend), or none (then causal, aligned to the last key, as sdpa's ``is_causal``)."""
    if mask is None:
        if not causal:
            return scores
        q, k = scores.shape[-2:]
        keep = torch.ones(q, k, dtype=torch.bool, device=scores.device).tril(k - q)
        return scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask.float()


def _scaled(module: nn.Module, query, key, value, attention_mask, scaling, dropout):
    """Megatron's fp16 path: scores divided by the layer number in fp16, multiplied back in fp32."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise NotImplementedError(f"query_key_layer_scaling: {type(module).__name__} has no layer_idx")
    coeff = float(layer + 1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if key.shape[1] != query.shape[1]:  # grouped key/value heads
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    # the factor goes on the query, before the product: fp16 q k^T itself is what overflows
    scores = torch.matmul(query * (scaling / coeff), key.transpose(-1, -2))  # fp16, 1/L of the usual size
    causal = query.shape[2] > 1 and getattr(module, "is_causal", True)
    probs = torch.softmax(_masked(scores.float() * coeff, attention_mask, causal), dim=-1).to(value.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _implementation(base: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.dtype != torch.float16:
            return _base_attention(module, base)(module, query, key, value, attention_mask, scaling=scaling,
                                                 dropout=dropout, **kwargs)
        return _scaled(module, query, key, value, attention_mask, scaling, dropout)

    attention.__name__ = f"{PREFIX}{base}"
    return attention


def enable(model: nn.Module) -> None:
    """Switch an HF model's attention to the layer-scaled form of its current implementation.

    Raises:
        NotImplementedError: for a model whose attention implementation cannot be chosen, or
            whose current one is not ``eager`` or ``sdpa``.
    """
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "set_attn_implementation", None)):
        raise NotImplementedError(f"query_key_layer_scaling: {type(model).__name__} is not an HF model whose "
                                  "attention implementation can be chosen")
    base = config._attn_implementation
    if base.startswith(PREFIX):
        return
    if base not in BASES:
        raise NotImplementedError(f"query_key_layer_scaling with attention implementation {base!r}: only "
                                  f"{' and '.join(BASES)} can be scaled")
    name = PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _implementation(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)
