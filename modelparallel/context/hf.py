"""Context-parallel attention inside Hugging Face models, without forking any modeling code.

Two ways in, chosen by the architecture's ``ContextSpec``:

- Models whose attention modules call HF's attention interface (Llama, Mistral, GPT-2) get the
  config's ``_attn_implementation`` set to ``ATTENTION``, registered in HF's
  ``AttentionInterface``; HF passes the module, q, k, v, the scale and the sliding window.
- Models with their own attention method (GPT-J's and GPT-Neo's ``_attn``) get that method
  replaced on each attention module by one that runs the same computation context-parallel.

Either way the attention mask HF would build for the local chunk is skipped (``AttentionMask
Interface`` entry returning None): masking follows the chunks' global positions instead.
"""

from __future__ import annotations

import types

from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface

from .attention import Ring, context_attention
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


def _refuse_dropout(module: nn.Module, p: float) -> None:
    if p > 0:
        raise NotImplementedError(
            f"{type(module).__name__}: attention dropout {p} under context parallelism is not implemented; "
            "set the config's attention dropout to 0 (or call model.eval())")


def _interface_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         sliding_window=None, softcap=None, **kwargs):
    """HF's attention-interface contract: q [B, H, L, D], k/v [B, H_kv, L, D] -> ([B, L, H, D], None)."""
    _refuse_dropout(module, dropout)
    if softcap is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention logit soft-capping under context "
                                  "parallelism is not implemented")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = context_attention(query, key, value, ring_of(module), scale, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """No mask for the local chunk: context-parallel attention masks by global position itself."""
    return None


def register() -> None:
    """Make ``ATTENTION`` known to HF's attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION, _interface_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


def _method(spec: ContextSpec):
    def attend(self, query, key, value, attention_mask=None, *args, **kwargs):
        if self.training:
            _refuse_dropout(self, spec.dropout(self))
        return context_attention(query, key, value, ring_of(self), spec.scale(self), spec.window(self)), None
    return attend


def install(module: nn.Module, ring: Ring, spec: ContextSpec) -> None:
    """Route one self-attention module's attention through context parallelism over ``ring``."""
    module.__dict__[RING] = ring
    if spec.method is not None:
        if not callable(getattr(module, spec.method, None)):
            raise ValueError(f"{type(module).__name__} has no method {spec.method!r} to run context-parallel")
        module.__dict__[spec.method] = types.MethodType(_method(spec), module)
