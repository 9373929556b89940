"""``smp.nn.DistributedTransformerLMHead``: embeddings, a ``DistributedTransformer`` and an LM
head tied to the word embedding, the vocabulary split over the ranks (embedding rows and logits),
with the loss computed on the split logits. Position and token-type tables stay whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ....tp.loss import causal_lm_loss, masked_lm_loss
from ....tp.plan import ModulePlan
from .attention import MASKED
from .base import DistributedEmbedding, DistributedModule, InitEmbedding
from .layers import DistributedTransformer


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A 0-1 ``[N, S]`` mask (1 = masked position) as the additive ``[N, 1, 1, S]`` mask."""
    if mask is None:
        return None
    return (mask.to(dtype) * MASKED)[:, None, None, :]


class DistributedTransformerLMHead(DistributedModule):
    """Word embedding (``word_embedding``) + position embedding (``position_embedding``) [+ token
    type embedding (``token_type_embedding``) when ``num_token_types > 0``], dropout, a
    ``DistributedTransformer`` (``transformer``) and, with ``add_lm_head``, a bias-free linear LM
    head (``lm_head``) whose weight is the word embedding's.

    Forward takes ``(input_ids, attention_mask, token_type_ids, position_ids, labels)`` or, with
    ``add_cross_attention``, ``(input_ids, attention_mask, token_type_ids, position_ids,
    cross_states, cross_states, cross_mask, labels)`` (also accepted without the repeated
    ``cross_states``). Masks are 0-1 ``[N, S]`` with 1 marking a masked position; None entries are
    allowed. Returns the loss when ``labels`` is given (next-token prediction with
    ``causal_mask_size``, else labels aligned with positions; -100 ignored), else the logits
    ``[N, S, vocab_size]`` (the transformer's output without ``add_lm_head``).
    """

    tp_plan = ModulePlan(rules={"lm_head": "vocab_colwise"}, optional_rules=("lm_head",))

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096, vocab_size: int = 30522,
                 num_positions: int = 1024, attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, num_token_types: int = 0,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False, add_lm_head: bool = True,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, fp32_residual_addition: bool = False):
        super().__init__()
        self.add_cross_attention, self.causal_mask_size = add_cross_attention, causal_mask_size
        self.word_embedding = DistributedEmbedding(vocab_size, hidden_size, initializer_range=initializer_range)
        self.position_embedding = InitEmbedding(num_positions, hidden_size, std=initializer_range)
        if num_token_types > 0:
            self.token_type_embedding = InitEmbedding(num_token_types, hidden_size, std=initializer_range)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers, num_attention_heads, attention_head_size, hidden_size, intermediate_size,
            attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon, initializer_range,
            use_normal_initialization, causal_mask_size, add_cross_attention, pre_layernorm, post_layernorm,
            fp32_residual_addition)
        if add_lm_head:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
            self.lm_head.weight = self.word_embedding.weight

    def _unpack(self, inputs):
        inputs = tuple(inputs)
        if not self.add_cross_attention:
            ids, mask, types, positions, labels = inputs
            return ids, mask, types, positions, None, None, labels
        if len(inputs) not in (7, 8):
            raise ValueError(f"with add_cross_attention the inputs are 8 (or 7) entries, got {len(inputs)}")
        return (*inputs[:5], inputs[-2], inputs[-1])

    def forward(self, inputs):
        ids, mask, types, positions, cross_states, cross_mask, labels = self._unpack(inputs)
        if positions is None:
            positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
        h = self.word_embedding(ids) + self.position_embedding(positions)
        if types is not None and hasattr(self, "token_type_embedding"):
            h = h + self.token_type_embedding(types)
        h = self.dropout(h)
        if self.add_cross_attention:
            h = self.transformer((h, cross_states, additive_mask(mask, h.dtype), additive_mask(cross_mask, h.dtype)))[0]
        else:
            h = self.transformer((h, additive_mask(mask, h.dtype)))[0]
        if not hasattr(self, "lm_head"):
            return h
        logits = self.lm_head(h)
        if labels is None:
            return logits.full_tensor() if isinstance(logits, DTensor) else logits
        if isinstance(logits, DTensor):
            loss_fn = causal_lm_loss if self.causal_mask_size is not None else masked_lm_loss
            return loss_fn(logits, labels)
        if self.causal_mask_size is not None:
            labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
