"""SageMaker's module tree over a Hugging Face model: the attribute paths v1 scripts reach into.

Under tensor parallelism SageMaker replaces an HF transformer by its own modules, and scripts
then walk that tree: ``model.get_module().transformer.seq_layers`` (GPT-2),
``model.module.module.transformer.seq_layers`` (GPT-J), each layer's ``.attention`` and
``.output`` (to checkpoint activations per sublayer). Here the HF modules are the model, so the
tree is offered as aliases over them: ``seq_layers`` is the base model's list of blocks, a
block's ``attention`` / ``output`` are its attention and MLP modules. The aliases live in the
instances' ``__dict__``, not among their children: parameter names, state dicts, ``modules()``
and checkpoints are unchanged, and weights are the HF ones exactly.

An architecture gives its names as data (``Architecture.sagemaker`` in ``models/<arch>.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class SageMakerLayout:
    """Where SageMaker's distributed-transformer names fall in one HF architecture.

    Attributes:
        layers: the base model's list of blocks (offered as ``seq_layers``).
        attention: a block's attention module (offered as the block's ``attention``).
        output: a block's MLP module (offered as the block's ``output``).
        scores_in_fp32: HF computes this architecture's attention scores in float32 whatever
            the model's dtype, so ``query_key_layer_scaling`` (which guards fp16 scores against
            overflow) has nothing left to do.
    """

    layers: str
    attention: str
    output: str
    scores_in_fp32: bool = False


WRAPPER_LEVELS = 2
"""How many ``.module`` hops below the wrapped model SageMaker scripts take (its wrapper levels)."""


class WrapperView:
    """What ``model.module.module`` is in SageMaker (a wrapper level around the model): here
    a view forwarding every attribute to the model itself. It stops after ``WRAPPER_LEVELS``
    levels, so code that unwraps ``.module`` until none is left ends."""

    def __init__(self, model: nn.Module, level: int):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_level", level)

    def __getattr__(self, name: str):
        if name == "module":
            if self._level >= WRAPPER_LEVELS:
                raise AttributeError(f"{type(self._model).__name__} has no further SageMaker wrapper level .module")
            return WrapperView(self._model, self._level + 1)
        return getattr(self._model, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._model, name, value)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def __repr__(self) -> str:
        return f"WrapperView(level {self._level} of {type(self._model).__name__})"


def _alias(module: nn.Module, name: str, target) -> None:
    """``module.name`` -> ``target`` without registering a child (no new state-dict key); a
    name the module already has (a subclass's own attribute) is left as it is."""
    if getattr(module, name, None) is None:
        module.__dict__[name] = target


def offer_tree(model: nn.Module, layout: SageMakerLayout) -> None:
    """Add SageMaker's names to ``model`` (an HF model of the layout's architecture) in place:
    ``<base>.seq_layers``, each block's ``attention`` / ``output``, and ``model.module`` levels."""
    base = getattr(model, "base_model", model)
    blocks = base.get_submodule(layout.layers)
    _alias(base, "seq_layers", blocks)
    for block in blocks:
        _alias(block, "attention", block.get_submodule(layout.attention))
        _alias(block, "output", block.get_submodule(layout.output))
    _alias(model, "module", WrapperView(model, 1))
