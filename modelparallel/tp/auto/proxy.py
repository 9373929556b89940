"""The proxy the automatic plan is found and verified on: the user's model class, a copy of its
config cut to a few layers and a small vocabulary, built with real weights in fp32 on CPU.

The plan is a property of the architecture (which modules, which layouts, which per-rank sizes),
not of the weights or the depth, so a two-layer model of the same class answers for the whole
one, whether the user's model is real, on the meta device or real on rank 0 only. Widths (hidden
size, heads, head dimension) are kept: they decide what a rank holds. Every rank builds the
same proxy (same seed), so the verification compares like with like without communication.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

PROXY_LAYERS = 2
"""Layers kept: alternating layer kinds (sliding / global attention) are covered by two."""

PROXY_VOCAB = 256
"""Largest vocabulary kept (the LM head's shards and the loss see every rank's slice already)."""

_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id")


def on_cpu(fn):
    """Run ``fn`` with CPU as the default device: the proxy and every tensor its forward and the
    simulated splits create (index tensors, masks, positions) are CPU tensors, whatever the
    caller's default (a model built under ``torch.device("meta")`` would otherwise get meta
    tensors there, with no values)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.device("cpu"):
            return fn(*args, **kwargs)

    return wrapper


def _layers(config) -> int | None:
    return getattr(config, "num_hidden_layers", None)


def proxy_config(config, vocab: int = PROXY_VOCAB):
    """A copy of ``config`` with at most ``PROXY_LAYERS`` layers (per-layer lists cut alike) and
    at most ``vocab`` tokens (token ids outside it dropped)."""
    config = copy.deepcopy(config)
    layers = _layers(config)
    if layers and layers > PROXY_LAYERS:
        for name, value in list(vars(config).items()):
            if isinstance(value, (list, tuple)) and len(value) == layers:
                setattr(config, name, type(value)(value[:PROXY_LAYERS]))
        config.num_hidden_layers = PROXY_LAYERS
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size > vocab:
        config.vocab_size = vocab
        for name in _TOKEN_IDS:
            value = getattr(config, name, None)
            if isinstance(value, int) and value >= vocab or isinstance(value, list) and any(v >= vocab for v in value):
                setattr(config, name, None)
    return config


def build_proxy(model: nn.Module, seed: int = 0) -> nn.Module:
    """A real fp32 model of ``model``'s class on CPU from ``proxy_config(model.config)``, initialized
    by HF from ``seed`` (the global RNG is restored afterwards), in eval mode (no dropout)."""
    config = proxy_config(model.config)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device("cpu"):
            proxy = type(model)(config)
    finally:
        torch.random.set_rng_state(state)
    return proxy.float().eval()


def probe_ids(config, rows: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    """A fixed random batch of token ids for the proxy: [rows, seq], shorter than its positions."""
    positions = getattr(config, "max_position_embeddings", None) or seq
    seq = max(2, min(seq, positions - 1))
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (rows, seq), generator=generator)
