"""What a model built in SageMaker v1's ``smp.model_creation`` / ``smp.delay_param_initialization``
carries for ``DistributedModel``: the options remembered on its modules, and what they change
(the plan without vocabulary sharding, the attention implementation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..models import architecture_for
from ..tp.plan import ArchSpec, ModulePlan
from . import qk_scaling

_VOCAB_STYLES = ("vocab_embedding", "vocab_colwise")


@dataclass(frozen=True)
class CreationOptions:
    """What ``DistributedModel`` must do with a model built in ``model_creation``."""

    delayed: bool = True
    dtype: torch.dtype | None = None
    distribute_embedding: bool = True
    attn_implementation: str | None = None
    query_key_layer_scaling: bool = False


def options_of(module: nn.Module) -> CreationOptions | None:
    """The creation options a model was built with, or None outside the contexts."""
    return next((m.__dict__["_mp_creation"] for m in module.modules() if "_mp_creation" in m.__dict__), None)


def without_vocab(spec: ArchSpec | None) -> ArchSpec | None:
    """``spec`` with the embedding and LM-head rules removed (``distribute_embedding=False``)."""
    if spec is None:
        return None

    def strip(plan: ModulePlan) -> ModulePlan:
        rules = {k: v for k, v in plan.rules.items() if v not in _VOCAB_STYLES}
        return dataclasses.replace(plan, rules=rules)

    return dataclasses.replace(spec, base=strip(spec.base), head=strip(spec.head))


def apply_attention(module: nn.Module, options: CreationOptions | None) -> None:
    """Switch an HF model to the attention implementation ``flash_attention`` asked for, then to
    its layer-scaled form with ``query_key_layer_scaling`` (unless its scores are fp32 anyway)."""
    if options is None:
        return
    if options.attn_implementation is not None:
        if not callable(getattr(module, "set_attn_implementation", None)):
            raise NotImplementedError(f"flash_attention: {type(module).__name__} is not an HF model whose "
                                      "attention implementation can be chosen")
        module.set_attn_implementation(options.attn_implementation)
    layout = getattr(architecture_for(module), "sagemaker", None)
    if options.query_key_layer_scaling and not (layout is not None and layout.scores_in_fp32):
        qk_scaling.enable(module)
