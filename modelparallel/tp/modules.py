"""Modules that carry their own tensor-parallel plan: ``DistributedModule`` and its two leaf layers
(``smp.nn.DistributedLinear``, ``smp.nn.DistributedEmbedding``), which the walker shards in place.

A distributed module is an ordinary module whose layout equals the single-process reference
(same submodules, same parameter names, global sizes), plus a ``ModulePlan`` saying which of its
layers to shard. ``DistributedModel`` hands the plan to the tensor-parallel walker, which shards
the module in place like any planned block; before that the module computes on one rank exactly
what the reference computes, so it can be built, initialized, saved and loaded undistributed.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .plan import ModulePlan


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
            from .embedding import _VocabParallelEmbedding

            return _VocabParallelEmbedding.forward(self, ids)
        return super().forward(ids)


def init_params(cls: type) -> set[str]:
    """Names ``cls.__init__`` accepts (excluding ``self`` and ``*args`` / ``**kwargs``)."""
    sig = inspect.signature(cls.__init__)
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n for n, p in list(sig.parameters.items())[1:] if p.kind not in kinds}


def _built_in(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        if sub.__module__.startswith("modelparallel.") and sub.__name__.startswith("Distributed"):
            out.append(sub)
        out.extend(_built_in(sub))
    return out


def constructor_args() -> frozenset[str]:
    """Every keyword some built-in distributed module's constructor takes (``tensor_parallelism
    (**kwargs)`` passes those on as overrides). The built-in modules are this library's own
    subclasses of ``DistributedModule``, found through Python's subclass links so the engine
    names none of the ``smp.nn`` classes itself."""
    out: set[str] = set()
    for cls in _built_in(DistributedModule):
        out |= init_params(cls)
    return frozenset(out)
