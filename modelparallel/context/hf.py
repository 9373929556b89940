"""Context-parallel attention inside Hugging Face models, without forking any modeling code.

Two ways in, chosen by the architecture's ``ContextSpec``:

- Models whose attention modules call HF's attention interface (Llama, Mistral, GPT-2) get the
  config's ``_attn_implementation`` set to ``ATTENTION``, registered in HF's
  ``AttentionInterface``; HF passes the module, q, k, v, the scale and the sliding window.
- Models with their own attention method (GPT-J's and GPT-Neo's ``_attn``) get that method
  replaced on each attention module by one that runs the same computation context-parallel.

Attention dropout (HF passes the probability in training, 0 in eval; a method adapter reads it
from the ``ContextSpec``) is ``dropout``'s: the same distribution as HF's, other draws.

Either way no mask is built for the local chunk: causality and windows follow the chunks' global
positions. The ``AttentionMaskInterface`` entry hands the 2-D padding mask through as it came
(``inputs`` has replaced the rank's [B, L] mask by the whole sequences' [B, S] one, or by None
when nothing is padded), so it reaches the attention as its ``attention_mask``. Whether attention
is causal is the module's ``is_causal`` (BERT's self-attention: False unless a decoder).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface

from .attention import Ring, context_attention
from .decode import decode_attention
from .spec import ContextSpec

ATTENTION = "modelparallel_context_parallel"
"""The ``_attn_implementation`` name of context-parallel attention."""

RING = "_mp_context_ring"
"""Attribute of each self-attention module under context parallelism: its ``attention.Ring``."""


def ring_of(module: nn.Module) -> Ring:
    """The ``Ring`` set on an attention module by ``context.parallelize``."""
    ring = module.__dict__.get(RING)
    if ring is None:
        raise RuntimeError(f"{type(module).__name__} runs {ATTENTION!r} attention but was not set up by "
                           "modelparallel's context parallelism (its config was copied to another model?)")
    return ring


def _key_mask(module: nn.Module, mask) -> torch.Tensor | None:
    """The whole sequences' [B, S] bool key mask handed through by ``_padding_mask``, or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise NotImplementedError(f"{type(module).__name__}: an attention mask other than a 2-D padding mask "
                                  f"({getattr(mask, 'shape', type(mask).__name__)}) under context parallelism "
                                  "is not implemented")
    return mask.bool()


def _attend(module, query, key, value, scale, window, causal, keys, dropout):
    """Context-parallel attention, or, when the keys outnumber the queries (a decode step over the
    whole gathered cache, ``decode``), plain attention on every rank alike."""
    if key.shape[2] != query.shape[2]:
        return decode_attention(query, key, value, scale, window, causal, keys, dropout)
    return context_attention(query, key, value, ring_of(module), scale, window, causal=causal, keys=keys,
                             dropout=dropout)


def _interface_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         sliding_window=None, softcap=None, **kwargs):
    """HF's attention-interface contract: q [B, H, L, D], k/v [B, H_kv, L, D] -> ([B, L, H, D], None)."""
    if softcap is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention logit soft-capping under context "
                                  "parallelism is not implemented")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _attend(module, query, key, value, scale, sliding_window, getattr(module, "is_causal", True),
                  _key_mask(module, attention_mask), dropout)
    return out.transpose(1, 2).contiguous(), None


def _padding_mask(*args, attention_mask=None, **kwargs):
    """The 2-D padding mask as given (the whole sequences', or None): context-parallel attention
    masks causality by global position itself, and padding per key chunk."""
    return attention_mask


def register() -> None:
    """Make ``ATTENTION`` known to HF's attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION, _interface_attention)
    AttentionMaskInterface.register(ATTENTION, _padding_mask)


def _method(spec: ContextSpec):
    def attend(self, query, key, value, attention_mask=None, *args, **kwargs):
        dropout = spec.dropout(self) if self.training else 0.0
        return _attend(self, query, key, value, spec.scale(self), spec.window(self), True,
                       _key_mask(self, attention_mask), dropout), None
    return attend


def install(module: nn.Module, ring: Ring, spec: ContextSpec) -> None:
    """Route one self-attention module's attention through context parallelism over ``ring``."""
    module.__dict__[RING] = ring
    if spec.method is not None:
        if not callable(getattr(module, spec.method, None)):
            raise ValueError(f"{type(module).__name__} has no method {spec.method!r} to run context-parallel")
        module.__dict__[spec.method] = types.MethodType(_method(spec), module)
