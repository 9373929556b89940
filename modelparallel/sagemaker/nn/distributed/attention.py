"""``smp.nn.DistributedAttentionLayer``: multi-head self- or cross-attention, heads split over the
tensor-parallel ranks (query/key/value column-parallel, the output projection row-parallel)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ....tp.plan import ModulePlan, SharedInput
from .base import DistributedModule, FusedLayerNorm, InitLinear, check_layernorms

MASKED = -10000.0
"""Additive score of a position the causal mask hides (as in GPT-2 and BERT)."""


class DistributedAttentionLayer(DistributedModule):
    """Attention block: ``dense(softmax(q k^T / sqrt(d) + mask) v)``, dropout, then the residual.

    Args:
        num_attention_heads: heads across all ranks (divisible by the degree).
        attention_head_size: channels per head; query/key/value map ``hidden_size`` to
            ``num_attention_heads * attention_head_size``.
        hidden_size: last dimension of the input.
        attention_dropout_prob: dropout on the attention probabilities.
        hidden_dropout_prob: dropout on the block's output.
        layernorm_epsilon: epsilon of the layer norms.
        initializer_range: standard deviation of the weights with ``use_normal_initialization``.
        use_normal_initialization: N(0, initializer_range) weights and zero biases, else
            PyTorch's default initialization.
        cross_attention: keys and values from ``cross_states``.
        causal_mask_size: None, or the longest sequence; positions then see only earlier ones.
        pre_layernorm: layer norm on the input (``pre_layernorm`` submodule).
        post_layernorm: layer norm on ``output + input`` (``layernorm`` submodule).

    Forward takes ``(hidden_states, attention_mask)`` or, with ``cross_attention``,
    ``(hidden_states, cross_states, attention_mask)``; the mask is additive, ``[N, 1, 1, S]``.
    Returns one tensor ``[N, S, hidden_size]``.
    """

    tp_plan = ModulePlan(rules={"query": "colwise", "key": "colwise", "value": "colwise", "dense": "rowwise"},
                         per_rank_attrs={"": ("local_attention_heads",)},
                         shared_inputs={"": SharedInput(output_of="projection_input")})
    """q, k and v read their input through ``projection_input`` (an identity): under tensor
    parallelism the input's gradient is then all-reduced once for the three projections, not
    once each (for cross-attention: once for q's input, once for k and v's)."""

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, cross_attention: bool = False,
                 causal_mask_size: int | None = None, pre_layernorm: bool = False, post_layernorm: bool = True):
        super().__init__()
        check_layernorms("DistributedAttentionLayer", pre_layernorm, post_layernorm)
        self.num_attention_heads = self.local_attention_heads = num_attention_heads
        self.attention_head_size = attention_head_size
        self.hidden_size = hidden_size
        self.cross_attention = cross_attention
        self.causal_mask_size = causal_mask_size
        std = initializer_range if use_normal_initialization else None
        inner = num_attention_heads * attention_head_size
        self.query = InitLinear(hidden_size, inner, std=std)
        self.key = InitLinear(hidden_size, inner, std=std)
        self.value = InitLinear(hidden_size, inner, std=std)
        self.dense = InitLinear(inner, hidden_size, std=std)
        self.projection_input = nn.Identity()
        self.dropout1 = nn.Dropout(attention_dropout_prob)
        self.dropout2 = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = FusedLayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.layernorm = FusedLayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[N, S, heads_here * d] -> [N, heads_here, S, d]."""
        return x.view(*x.shape[:-1], self.local_attention_heads, self.attention_head_size).transpose(1, 2)

    def _causal(self, scores: torch.Tensor) -> torch.Tensor:
        q, k = scores.shape[-2:]
        if k > self.causal_mask_size:
            raise ValueError(f"sequence length {k} exceeds causal_mask_size {self.causal_mask_size}")
        keep = torch.ones(q, k, dtype=torch.bool, device=scores.device).tril(k - q)
        return scores.masked_fill(~keep, MASKED)

    def forward(self, inputs):
        if self.cross_attention:
            hidden_states, cross_states, attention_mask = inputs
        else:
            (hidden_states, attention_mask), cross_states = inputs, None
        norm = self.pre_layernorm(hidden_states) if self.pre_layernorm is not None else hidden_states
        norm = self.projection_input(norm)
        source = norm if cross_states is None else self.projection_input(cross_states)
        q, k, v = self._heads(self.query(norm)), self._heads(self.key(source)), self._heads(self.value(source))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if not self.cross_attention and self.causal_mask_size is not None:
            scores = self._causal(scores)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = self.dropout1(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2)
        out = self.dropout2(self.dense(context.reshape(*context.shape[:2], -1)))
        if self.layernorm is not None:
            return self.layernorm(out + hidden_states)
        return out + hidden_states
