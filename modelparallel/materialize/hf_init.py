"""Run Hugging Face's own initialization on single modules: weights, and recomputed buffers.

Transformers 5 ``PreTrainedModel._init_weights(module)`` initializes one module's parameters and
also recomputes the buffers a meta-device build leaves empty: rotary ``inv_freq``, BERT's
``position_ids``, GPT-Neo's causal masks, GPT-J's sinusoidal table. Reusing it (instead of
rebuilding each architecture's buffers here) keeps this file free of per-model code and follows
HF when a model changes. Its ``transformers.initialization`` functions skip any tensor flagged
``_is_hf_initialized``, which is how buffers are recomputed without touching loaded weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..pipeline.split import eager_named_children

try:  # transformers >= 5
    from transformers.initialization import guard_torch_init_functions
except ImportError:  # pragma: no cover - older transformers
    guard_torch_init_functions = contextlib.nullcontext


def is_hf_model(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")


def tie_as_config(model: nn.Module) -> bool:
    """Tie ``model``'s weights as its HF config says (``tie_word_embeddings``...), with HF's own
    ``tie_weights``; returns whether that tied anything that was separate.

    HF ties in ``init_weights``, which scripts sometimes replace to skip initialization
    (``PreTrainedModel.init_weights = lambda x: None``): the LM head is then a second, untied
    copy that trains apart from the embedding, silently. HF models only; others are untouched.
    """
    if not is_hf_model(model) or not callable(getattr(model, "tie_weights", None)):
        return False
    before = sum(1 for _ in model.parameters())
    model.tie_weights()
    return sum(1 for _ in model.parameters()) < before


def owners(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the innermost HF model containing it (composite models nest several)."""
    out: dict[int, nn.Module] = {}

    def visit(mod: nn.Module, owner: nn.Module | None) -> None:
        owner = mod if is_hf_model(mod) else owner
        if owner is not None:
            out.setdefault(id(mod), owner)
        for _, child in eager_named_children(mod):  # at pipeline degree > 1 other stages' modules too
            visit(child, owner)

    visit(model, None)
    return out


def hf_init_fn(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """A callable initializing one module of ``model`` the way HF does, or None if ``model``
    contains no HF model."""
    table = owners(model)
    if not table:
        return None

    def init(module: nn.Module) -> None:
        owner = table.get(id(module))
        if owner is not None:
            with torch.no_grad(), guard_torch_init_functions():
                owner._init_weights(module)

    return init


def default_init_fn(model: nn.Module) -> Callable[[nn.Module], None]:
    """HF's ``_init_weights`` for HF models, else each module's own ``reset_parameters``."""
    hf = hf_init_fn(model)
    if hf is not None:
        return hf

    def reset(module: nn.Module) -> None:
        if callable(getattr(module, "reset_parameters", None)):
            with torch.no_grad():
                module.reset_parameters()

    return reset


@contextlib.contextmanager
def frozen(tensors: Iterable[torch.Tensor]):
    """Flag ``tensors`` as initialized for HF's guarded init functions, so an ``_init_weights``
    call writes only the others; flags are removed afterwards."""
    flagged = [t for t in tensors if not getattr(t, "_is_hf_initialized", False)]
    for t in flagged:
        t._is_hf_initialized = True
    try:
        yield
    finally:
        for t in flagged:
            with contextlib.suppress(AttributeError):
                del t._is_hf_initialized
