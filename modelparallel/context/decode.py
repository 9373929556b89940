"""Generation under context parallelism: the prompt split over the ranks, the new tokens on every rank.

``generate`` calls the model with a key/value cache: first the whole prompt (the prefill), then
one new token at a time. Under context parallelism:

1. Prefill: every rank passes the whole prompt (``generate``'s own inputs, the same on every
   rank); the forward pre-hook takes this rank's part of it (``layout.split``: input ids, the
   position ids ``generate`` derived from the mask) and keeps the whole padding mask. Attention
   runs context-parallel, and the cache holds this rank's keys and values.
2. After the prefill the forward hook gathers every layer's cached keys and values into the
   whole sequence, in order, on every rank, and hands every rank the logits of the prompt's last
   token (held by context-parallel rank 0, whose second chunk ends the sequence).
3. Decode steps run on every rank alike: the new token's query attends to the whole cache
   (``decode_attention``, plain attention; a query shorter than its keys marks a decode step).

The prompt's attention, the costly part for long prompts, is split; each new token's attention
is not (it is one query row). Only caches whose layers keep every token (``DynamicLayer``) are
gathered; sliding-window and static caches are refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..compat import all_gather_single
from .attention import Ring
from .layout import check_split, merge, split

_SPLIT = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")


def _cache_layers(cache) -> list:
    from transformers.cache_utils import DynamicLayer  # the one layer type whose tokens are all kept

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or ()}) or [type(cache).__name__]
        raise NotImplementedError(f"a key/value cache of {', '.join(kinds)} under context parallelism is not "
                                  "implemented; generation runs with a DynamicCache of full-attention layers")
    return layers


def prepare(ring: Ring, kw: dict) -> bool:
    """Set up one ``generate`` step's inputs (``kw`` in place); True for the prefill.

    Raises:
        NotImplementedError: a cache other than a ``DynamicCache`` of full layers.
        ValueError: a prompt that does not split into 2C chunks.
    """
    cache = kw["past_key_values"]
    _cache_layers(cache)
    if cache.get_seq_length() > 0:
        return False  # a decode step: the same inputs on every rank, the whole cache
    tokens = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
    check_split(tokens.shape[1], ring.size, "prompt length")
    length = tokens.shape[1]
    for name in _SPLIT:
        value = kw.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            kw[name] = split(value, ring.size, ring.rank)
    mask = kw.get("attention_mask")
    if mask is not None:
        kw["attention_mask"] = None if bool(mask.all()) else mask.bool()
    return True


def _gather(ring: Ring, local: torch.Tensor, seq_dim: int) -> torch.Tensor:
    local = local.contiguous()
    everyone = local.new_empty((ring.size * local.shape[0],) + local.shape[1:])
    all_gather_single(everyone, local, group=ring.group)
    return merge(list(everyone.chunk(ring.size)), seq_dim=seq_dim)


def finish_prefill(ring: Ring, module: nn.Module, args: tuple, kwargs: dict, output):
    """The forward hook: after a prefill, the whole cache and the prompt's last logits on every
    rank (see the module doc); other calls pass through."""
    cache = kwargs.get("past_key_values")
    tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if cache is None or tokens is None or cache.get_seq_length() != tokens.shape[1]:
        return output
    for layer in _cache_layers(cache):
        layer.keys, layer.values = _gather(ring, layer.keys, 2), _gather(ring, layer.values, 2)
    logits = getattr(output, "logits", None)
    if logits is not None:
        output.logits = _last_logits(ring, logits, tokens.shape[1])
    return output


def _last_logits(ring: Ring, logits: torch.Tensor, length: int) -> torch.Tensor:
    """The whole prompt's logits (all were computed), or its last k (``logits_to_keep``): rank
    0's last k, broadcast."""
    if logits.shape[1] == length:
        return _gather(ring, logits, 1)
    if logits.shape[1] > length // 2:
        raise NotImplementedError(f"logits_to_keep={logits.shape[1]} under context parallelism: at most "
                                  f"{length // 2} (one chunk) or all")
    last = logits.contiguous()
    dist.broadcast(last, dist.get_global_rank(ring.group, 0), group=ring.group)
    return last


def decode_attention(q, k, v, scale: float, window: int | None, causal: bool, keys: torch.Tensor | None,
                     dropout: float = 0.0) -> torch.Tensor:
    """Plain attention of ``q`` [B, H, t, D], the last t of ``k``/``v``'s [B, H_kv, K, D]
    tokens (a decode step), over the whole cache; ``keys`` [B, K] bool padding, or None."""
    t, total = q.shape[2], k.shape[2]
    i = torch.arange(t, device=q.device).unsqueeze(1) + (total - t)
    j = torch.arange(total, device=q.device).unsqueeze(0)
    seen = (j <= i) if causal else torch.ones(t, total, dtype=torch.bool, device=q.device)
    if window is not None:
        seen = seen & (i - j < window)
    mask = seen if keys is None else seen & keys[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
