"""``TransformerLayer``: the class v2 scripts name for "one transformer block of a transformed
model" (SageMaker v2's ``torch.sagemaker.tensor_parallel.transformer``).

SageMaker's ``transform`` replaces each Hugging Face block by its own ``TransformerLayer``, and
scripts then pass that class to FSDP's ``transformer_auto_wrap_policy`` and to
``apply_activation_checkpointing``'s ``check_fn``. Here the Hugging Face block itself is the
layer (we parallelize HF modules, we do not replace them), so ``TransformerLayer`` is a class
that ``isinstance`` matches against those blocks: ``transform`` marks every module whose class
the model lists as a block (HF's ``_no_split_modules``: ``LlamaDecoderLayer``, ``GPT2Block``...),
and ``isinstance(module, TransformerLayer)`` is true exactly for the marked modules.
"""

from __future__ import annotations

from torch import nn

MARK = "_mp_transformer_layer"


class _IsMarkedBlock(type):
    """Metaclass answering ``isinstance`` by the mark ``transform`` leaves on a block."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, nn.Module) and bool(obj.__dict__.get(MARK, False))


class TransformerLayer(metaclass=_IsMarkedBlock):
    """Matches (with ``isinstance``) the transformer blocks of a model passed through
    ``transform``; not instantiated (the model's own block class is the layer)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "TransformerLayer is not built here: transform keeps the Hugging Face blocks "
            "(isinstance(block, TransformerLayer) is true for them); build the HF model instead")


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
