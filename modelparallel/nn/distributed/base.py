"""The base of the ``smp.nn`` distributed modules and their leaf layers.

A distributed module is an ordinary module whose layout equals the single-process reference
(same submodules, same parameter names, global sizes), plus a ``ModulePlan`` saying which of its
layers to shard. ``DistributedModel`` hands the plan to the tensor-parallel walker, which shards
the module in place like any planned block; before that the module computes on one rank exactly
what the reference computes, so it can be built, initialized, saved and loaded undistributed.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...tp.plan import ModulePlan


class DistributedModule(nn.Module):
    """Base class of modules the library knows how to distribute.

    Subclasses set ``tp_plan`` (rules relative to the module itself, ``""`` naming the module)
    when they own layers to shard; composite modules leave it None and let their distributed
    children carry the plans.
    """

    tp_plan: ClassVar[ModulePlan | None] = None

    def __new__(cls, *args, **kwargs):
        # the constructor arguments, to rebuild the module with tensor_parallelism(**overrides)
        obj = super().__new__(cls)
        obj.__dict__["_mp_init_args"] = (args, kwargs)
        return obj


def not_implemented(owner: str, **options) -> None:
    """Raise ``NotImplementedError`` naming every option set away from its default."""
    wrong = [f"{k}={v!r}" for k, v in options.items() if v]
    if wrong:
        raise NotImplementedError(f"{owner}: options not implemented: {', '.join(wrong)}")


def check_activation(activation: str) -> str:
    if activation not in ("gelu", "relu"):
        raise ValueError(f"activation must be 'gelu' or 'relu', got {activation!r}")
    return activation


def check_layernorms(owner: str, pre_layernorm: bool, post_layernorm: bool) -> None:
    if not (pre_layernorm or post_layernorm):
        raise ValueError(f"{owner}: at least one of pre_layernorm and post_layernorm must be True")


class InitLinear(nn.Linear):
    """``nn.Linear`` whose ``reset_parameters`` draws N(0, ``std``) weights and zero biases when
    ``std`` is set (``use_normal_initialization``), else PyTorch's default. Delayed parameter
    initialization calls ``reset_parameters``, so both paths give the same distribution."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float | None = None):
        self.std = std
        super().__init__(in_features, out_features, bias)

    def reset_parameters(self) -> None:
        if self.std is None:
            super().reset_parameters()
            return
        nn.init.normal_(self.weight, 0.0, self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class InitEmbedding(nn.Embedding):
    """``nn.Embedding`` drawn N(0, ``std``), kept whole on every rank (position and token-type
    tables: small, and often smaller than the degree)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 0.02):
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.std)


class _AnyLayerNorm(type):
    """``isinstance(m, FusedLayerNorm)`` holds for every ``nn.LayerNorm``: SageMaker v1 scripts
    find the layer norms of its distributed transformer that way (to exclude them from weight
    decay), and here that transformer is the HF model, whose norms are ``nn.LayerNorm``."""

    def __instancecheck__(cls, obj) -> bool:
        if cls.__name__ == "FusedLayerNorm" and cls.__module__ == __name__:
            return isinstance(obj, nn.LayerNorm)
        return super().__instancecheck__(obj)


class FusedLayerNorm(nn.LayerNorm, metaclass=_AnyLayerNorm):
    """``smp.nn.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``: layer
    normalization; PyTorch picks its fused kernel itself, so this is ``nn.LayerNorm`` (and every
    ``nn.LayerNorm`` counts as one for ``isinstance``, see ``_AnyLayerNorm``)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)


class DistributedLinear(DistributedModule, nn.Linear):
    """Tensor-parallel ``nn.Linear`` with global ``in_features`` / ``out_features``.

    Input and output are whole on every rank, as for ``nn.Linear``: the weight's rows (output
    features) are split over the ranks and the partial outputs gathered. ``out_features`` must be
    divisible by the degree (``DistributedModel`` raises naming it).
    """

    tp_plan = ModulePlan(rules={"": "colwise_gather"})

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)


class DistributedEmbedding(DistributedModule, nn.Embedding):
    """Tensor-parallel ``nn.Embedding`` (SageMaker's signature), weights drawn N(0,
    ``initializer_range``) with the padding row zero.

    The vocabulary (rows) is split over the ranks, each rank looks up its own rows and one
    all-reduce sums the lookups; the output is whole on every rank. Rows may split unevenly.
    """

    tp_plan = ModulePlan(rules={"": "vocab_embedding"})
    vocab_parallel_forward = True  # the vocab style keeps this class (its forward handles shards)

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: torch.Tensor | None = None, initializer_range: float = 0.02,
                 _skip_allgather: bool = False, _skip_scatter_and_merge: bool = False):
        not_implemented("DistributedEmbedding", max_norm=max_norm is not None, sparse=sparse,
                        _skip_allgather=_skip_allgather, _skip_scatter_and_merge=_skip_scatter_and_merge)
        self.initializer_range = initializer_range
        super().__init__(num_embeddings, embedding_dim, padding_idx, None, norm_type, scale_grad_by_freq,
                         False, _weight)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.initializer_range)
        self._fill_padding_idx_with_zero()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            from ...tp.embedding import _VocabParallelEmbedding

            return _VocabParallelEmbedding.forward(self, ids)
        return super().forward(ids)
