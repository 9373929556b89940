"""Single-process reference transformer modules written from SageMaker's appendix of reference
implementations (plain ``nn.Linear`` / ``nn.LayerNorm``, the same submodule names), for
comparing the ``smp.nn`` distributed modules against.

Written independently of the library. Where the appendix returns a block's output without the
residual when ``post_layernorm=False``, this reference adds the residual (pre-layer-norm
transformers such as GPT-2 need it; docs/models.md states the choice).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MASKED = -10000.0


class RefAttention(nn.Module):
    def __init__(self, num_attention_heads, attention_head_size, hidden_size, attention_dropout_prob=0.0,
                 hidden_dropout_prob=0.0, layernorm_epsilon=1e-5, cross_attention=False, causal_mask_size=None,
                 pre_layernorm=False, post_layernorm=True, **_):
        super().__init__()
        self.heads, self.size, self.cross, self.causal = num_attention_heads, attention_head_size, cross_attention, \
            causal_mask_size
        inner = num_attention_heads * attention_head_size
        self.query, self.key, self.value = (nn.Linear(hidden_size, inner) for _ in range(3))
        self.dense = nn.Linear(inner, hidden_size)
        self.dropout1, self.dropout2 = nn.Dropout(attention_dropout_prob), nn.Dropout(hidden_dropout_prob)
        self.use_pre, self.use_post = pre_layernorm, post_layernorm
        if pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        if post_layernorm:
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def transpose(self, t, key=False):
        t = t.reshape(t.shape[:-1] + (self.heads, self.size))
        return t.permute(0, 2, 3, 1) if key else t.permute(0, 2, 1, 3)

    def forward(self, inp):
        if self.cross:
            hidden, cross, mask = inp
        else:
            hidden, mask = inp
        norm = self.pre_layernorm(hidden) if self.use_pre else hidden
        src = cross if self.cross else norm
        q = self.transpose(self.query(norm))
        k, v = self.transpose(self.key(src), key=True), self.transpose(self.value(src))
        scores = torch.matmul(q, k) / math.sqrt(self.size)
        if not self.cross and self.causal is not None:
            s = scores.shape[-1]
            scores = torch.where(torch.tril(torch.ones(s, s, dtype=torch.bool)), scores, torch.tensor(MASKED))
        if mask is not None:
            scores = scores + mask
        probs = self.dropout1(F.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3)
        ctx = ctx.reshape(ctx.shape[:-2] + (self.heads * self.size,))
        out = self.dropout2(self.dense(ctx))
        return self.layernorm(out + hidden) if self.use_post else out + hidden


class RefOutput(nn.Module):
    def __init__(self, hidden_size, intermediate_size, hidden_dropout_prob=0.0, activation="gelu",
                 layernorm_epsilon=1e-5, pre_layernorm=False, post_layernorm=True, fp32_residual_addition=False, **_):
        super().__init__()
        self.dense1 = nn.Linear(hidden_size, intermediate_size)
        self.dense2 = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.act, self.fp32 = activation, fp32_residual_addition
        self.use_pre, self.use_post = pre_layernorm, post_layernorm
        if pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        if post_layernorm:
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, inp):
        norm = self.pre_layernorm(inp) if self.use_pre else inp
        h = self.dense1(norm)
        h = F.gelu(h) if self.act == "gelu" else F.relu(h)
        out = self.dropout(self.dense2(h))
        total = (inp.double() + out.double()).to(inp.dtype) if self.fp32 else inp + out
        return self.layernorm(total) if self.use_post else total


class RefLayer(nn.Module):
    def __init__(self, add_cross_attention=False, **kw):
        super().__init__()
        self.add_cross = add_cross_attention
        self.attention = RefAttention(**kw)
        if add_cross_attention:
            self.cross_attention = RefAttention(cross_attention=True, **kw)
        self.output = RefOutput(**kw)

    def forward(self, inp):
        if self.add_cross:
            hidden, cross, mask, cross_mask = inp
        else:
            hidden, mask = inp
        out = self.attention((hidden, mask))
        if self.add_cross:
            out = self.cross_attention((out, cross, cross_mask))
        out = self.output(out)
        return (out, cross, mask, cross_mask) if self.add_cross else (out, mask)


class RefTransformer(nn.Module):
    def __init__(self, num_layers, **kw):
        super().__init__()
        self.seq_layers = nn.Sequential(*(RefLayer(**kw) for _ in range(num_layers)))

    def forward(self, inp):
        return self.seq_layers(inp)


class RefLMHead(nn.Module):
    """Embeddings + transformer + tied LM head; the loss is next-token with a causal mask."""

    def __init__(self, num_layers, vocab_size, num_positions, hidden_size, num_token_types=0, **kw):
        super().__init__()
        self.causal = kw.get("causal_mask_size")
        self.word_embedding = nn.Embedding(vocab_size, hidden_size)
        self.position_embedding = nn.Embedding(num_positions, hidden_size)
        if num_token_types:
            self.token_type_embedding = nn.Embedding(num_token_types, hidden_size)
        self.transformer = RefTransformer(num_layers, hidden_size=hidden_size, **kw)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.lm_head.weight = self.word_embedding.weight

    def forward(self, ids, mask01, types, labels):
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        h = self.word_embedding(ids) + self.position_embedding(pos)
        if types is not None:
            h = h + self.token_type_embedding(types)
        h = self.transformer((h, mask01.float()[:, None, None, :] * MASKED))[0]
        logits = self.lm_head(h)
        if labels is None:
            return logits
        if self.causal is not None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
