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

from ...training.blocks import is_marked_block


class _IsMarkedBlock(type):
    """Metaclass answering ``isinstance`` by the mark ``transform`` leaves on a block."""

    def __instancecheck__(cls, obj) -> bool:
        return is_marked_block(obj)


class TransformerLayer(metaclass=_IsMarkedBlock):
    """Matches (with ``isinstance``) the transformer blocks of a model passed through
    ``transform``; not instantiated (the model's own block class is the layer)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "TransformerLayer is not built here: transform keeps the Hugging Face blocks "
            "(isinstance(block, TransformerLayer) is true for them); build the HF model instead")
