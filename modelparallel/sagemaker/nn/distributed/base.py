"""Leaf layers of the ``smp.nn`` distributed modules that the tensor-parallel engine does not need
(initialization-aware linear and embedding layers, ``FusedLayerNorm``) and their argument checks;
``DistributedModule`` and the sharded leaf layers are the engine's (``modelparallel/tp/modules.py``)."""

from __future__ import annotations

from torch import nn

from ....tp.modules import DistributedEmbedding, DistributedLinear, DistributedModule, not_implemented  # noqa: F401


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


