"""What context parallelism needs to know about one architecture (data, in models/<arch>.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ContextSpec:
    """How an architecture's self-attention is reached and parameterized under context parallelism.

    Attributes:
        attention: glob (relative to the base model) of the self-attention modules.
        method: None when those modules call Hugging Face's attention interface (``ALL_ATTENTION
            _FUNCTIONS[config._attn_implementation]``, which passes the scale and sliding window
            itself); else the name of their method ``(query, key, value, attention_mask) ->
            (output [B, H, S, D], weights)`` that computes the attention, replaced per module.
        scale: for a ``method``, the factor on ``q . k`` the method applies, from the module.
        window: for a ``method``, the module's sliding window (None: none).
        dropout: for a ``method``, the module's attention dropout probability.
        positions: ``(config, input_ids, length) -> [B or 1, length]`` the position ids HF's
            forward computes for whole sequences when none are given (``input_ids`` [B, S] whole,
            or None when ``inputs_embeds`` are given); None: 0..S-1, as most models count.
        heads: the model classes context parallelism runs (None: every one): an encoder's heads
            that pool the sequence (sequence classification) or index into it (question
            answering) would see only this rank's part.
    """

    attention: str
    method: str | None = None
    scale: Callable[[nn.Module], float] | None = None
    window: Callable[[nn.Module], int | None] = lambda module: None
    dropout: Callable[[nn.Module], float] = lambda module: 0.0
    positions: Callable[[object, torch.Tensor | None, int], torch.Tensor] | None = None
    heads: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.method is not None and self.scale is None:
            raise ValueError(f"ContextSpec({self.attention!r}): a method adapter needs its scale")
