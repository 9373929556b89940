"""Transformer blocks marked as such: ``transform`` marks every module whose class the model lists
as a block (HF's ``_no_split_modules``: ``LlamaDecoderLayer``, ``GPT2Block``...), so that FSDP's wrap
policy and activation checkpointing can find them (SageMaker v2's ``TransformerLayer`` reads the
mark: ``modelparallel/sagemaker/tensor_parallel/transformer.py``)."""

from __future__ import annotations

from torch import nn

MARK = "_mp_transformer_layer"


def is_marked_block(obj) -> bool:
    """Whether ``obj`` is a module ``mark_transformer_layers`` marked."""
    return isinstance(obj, nn.Module) and bool(obj.__dict__.get(MARK, False))


def block_class_names(model: nn.Module) -> set[str]:
    """Class names of the transformer blocks the Hugging Face models inside ``model`` declare."""
    names: set[str] = set()
    for mod in model.modules():
        names.update(getattr(mod, "_no_split_modules", None) or ())
    return names


def mark_transformer_layers(model: nn.Module) -> int:
    """Mark every transformer block of ``model`` as a ``TransformerLayer``; returns how many."""
    names = block_class_names(model)
    count = 0
    for mod in model.modules():
        if type(mod).__name__ in names:
            mod.__dict__[MARK] = True
            count += 1
    return count
