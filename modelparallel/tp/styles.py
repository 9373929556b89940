"""Parallel styles by name: PyTorch's DTensor styles, extended to HF's ``Conv1D`` and fused weights.

A plan names a style per module ("colwise", "rowwise", ...); ``build_style`` turns the name and
the module's type into a ``ParallelStyle``. Column- and row-parallel ``nn.Linear`` and HF ``Conv1D``
(weight [in, out], the transpose of ``nn.Linear``'s [out, in]) use ``local.LocalColwise`` /
``LocalRowwise``: DTensor parameters, local-tensor forward between Megatron's ``f`` and ``g``.
Vocabulary embeddings use ``embedding.VocabParallelEmbedding`` (its weight gradient stays a
shard); the vocabulary-parallel LM head and ``colwise_gather`` use PyTorch's ``ColwiseParallel``.
Fused (packed) projections get ``PackedColwise``.

Every style distributes with ``src_data_rank=None``: each rank slices its shard from its own copy
without communication, which is right because ``init`` seeds every rank alike and pretrained
weights are the same file on every rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from transformers.pytorch_utils import Conv1D

from .embedding import VocabParallelEmbedding
from .local import LocalColwise, LocalRowwise, column_input
from .sequence import keep_shards
from .plan import Packed
from .replicated import ReplicatedGradSum

STYLE_NAMES = ("colwise", "rowwise", "packed_colwise", "vocab_embedding", "vocab_colwise", "colwise_gather",
               "replicated_grad_sum", "kv_replicated")
"""colwise / rowwise: Megatron's column- and row-parallel linear layers. packed_colwise: a fused
projection (e.g. GPT-2's q|k|v) sharded chunk by chunk. vocab_embedding: embedding rows (the
vocabulary) sharded. vocab_colwise: an LM head sharded over the vocabulary whose logits stay
sharded, for the vocab-parallel loss. colwise_gather: column parallel with the output gathered,
a drop-in ``nn.Linear`` (whole input and output on every rank). replicated_grad_sum: a module
kept whole that each rank applies to its own heads, its gradients summed over the ranks.
kv_replicated: a key/value projection with its KV heads replicated, never named by a rule (the
walker derives it from a plan's ``KVHeads`` when the degree does not divide the KV heads)."""

NOT_SPLIT = ("replicated_grad_sum", "kv_replicated")
"""Styles that keep every parameter whole: no size for the degree to divide."""


def _replace(module: nn.Module, name: str, tensor: torch.Tensor, placements, mesh: DeviceMesh) -> None:
    param = getattr(module, name)
    dist = distribute_tensor(tensor.detach(), mesh, placements, src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class _PackedConv1D(Conv1D):
    """A ``Conv1D`` whose weight is stored [in, chunks, out/chunks] and sharded on the last dim, so
    each rank computes its own slice of every chunk: [q_r | k_r | v_r] for GPT-2's ``c_attn``."""

    def forward(self, x):
        x = column_input(self, x)
        weight = self.weight.to_local().flatten(1)  # [in, chunks * out_per_chunk / tp]
        bias = self.bias.to_local().flatten()
        with keep_shards(self):
            y = torch.addmm(bias, x.reshape(-1, x.size(-1)), weight)
        return y.view(*x.shape[:-1], -1)


class _PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is stored [chunks, out/chunks, in], sharded on dim 1."""

    def forward(self, x):
        x = column_input(self, x)
        weight = self.weight.to_local().flatten(0, 1)  # [chunks * out_per_chunk / tp, in]
        bias = None if self.bias is None else self.bias.to_local().flatten()
        with keep_shards(self):
            return nn.functional.linear(x, weight, bias)


def output_dims(module: nn.Module) -> dict[str, int]:
    """Where a module type keeps its outputs: ``Conv1D``'s weight is [in, out], ``nn.Linear``'s [out, in]."""
    return {"weight": 1 if isinstance(module, Conv1D) else 0, "bias": 0}


def packed_problem(path: str, module: nn.Module, packed: Packed) -> str | None:
    """Why ``packed`` cannot describe ``module`` (a fused dim that is not its output), or None."""
    want = output_dims(module)
    wrong = {n: d for n, d in (packed.dims or {}).items() if want.get(n) != d}
    if wrong:
        return (f"{path}: packed dims {wrong} are not the output dims of a {type(module).__name__} "
                f"({ {n: want[n] for n in wrong if n in want} })")
    return None


class PackedColwise(ParallelStyle):
    """Column parallel for a projection that fuses ``chunks`` equal outputs (q, k and v).

    A plain Shard of the fused dimension would give rank 0 all of q and part of k. Instead the
    weight is stored with an explicit chunk dimension and sharded inside every chunk. The stored
    (global) tensor is the HF tensor reshaped, so it does not depend on the degree and reshards.
    The split dims come from the plan's ``Packed`` descriptor (a bare count: the module type's
    output dims) and stay on the module as ``_mp_packed_dims``, where the loader reads them.
    """

    def __init__(self, chunks: int | Packed):
        super().__init__()
        self.packed = chunks if isinstance(chunks, Packed) else Packed(chunks)
        self.chunks = self.packed.chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, (Conv1D, nn.Linear)):
            raise NotImplementedError(f"packed_colwise supports nn.Linear and Conv1D, not {type(module).__name__}")
        problem = packed_problem(type(module).__name__, module, self.packed)
        if problem:
            raise ValueError(problem)
        dims = self.packed.dims or output_dims(module)
        for name, d in dims.items():
            if getattr(module, name, None) is not None:
                split = getattr(module, name).unflatten(d, (self.chunks, -1))
                _replace(module, name, split, [Shard(d + 1)], device_mesh)
        module.__dict__["_mp_packed_dims"] = dict(dims)
        module.__class__ = _PackedConv1D if isinstance(module, Conv1D) else _PackedLinear
        return module


def build_style(name: str, module: nn.Module, chunks: int | Packed = 1) -> ParallelStyle:
    """The ``ParallelStyle`` for style ``name`` applied to ``module`` (``chunks``: a packed
    module's ``Packed`` descriptor or chunk count).

    Raises:
        ValueError: for an unknown style name.
        NotImplementedError: for a module type the style cannot shard.
    """
    style = _new_style(name, isinstance(module, Conv1D), chunks)
    style.src_data_rank = None  # slice locally: every rank already holds the same weights (see top)
    return style


def _new_style(name: str, conv: bool, chunks: int | Packed) -> ParallelStyle:
    if name == "colwise":
        return LocalColwise()
    if name == "rowwise":
        return LocalRowwise()
    if name == "packed_colwise":
        return PackedColwise(chunks)
    if name == "vocab_embedding":
        return VocabParallelEmbedding()
    if name == "vocab_colwise":
        return ColwiseParallel(use_local_output=False)
    if name == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "replicated_grad_sum":
        return ReplicatedGradSum()
    if name == "kv_replicated":
        raise ValueError("kv_replicated is derived from a plan's KVHeads (the degree does not divide the KV "
                         "heads), not named by a rule")
    raise ValueError(f"unknown parallel style {name!r}; known styles: {', '.join(STYLE_NAMES)}")


SUPPORTED_TYPES = {
    "colwise": (nn.Linear, Conv1D),
    "rowwise": (nn.Linear, Conv1D),
    "packed_colwise": (nn.Linear, Conv1D),
    "vocab_embedding": (nn.Embedding,),
    "vocab_colwise": (nn.Linear,),
    "colwise_gather": (nn.Linear,),
    "replicated_grad_sum": (nn.Module,),
}


def sharded_size(name: str, module: nn.Module, chunks: int = 1) -> tuple[str, int]:
    """The dimension a style splits, as (description, size), for the walker's divisibility check."""
    if isinstance(module, nn.Embedding):
        return "num_embeddings (vocabulary)", module.num_embeddings
    in_f, out_f = (module.weight.shape[0], module.weight.shape[1]) if isinstance(module, Conv1D) \
        else (module.in_features, module.out_features)
    if name == "rowwise":
        return "in_features", in_f
    if name == "packed_colwise":
        return f"out_features per packed chunk ({out_f} / {chunks})", out_f // chunks
    return ("out_features (vocabulary)" if name == "vocab_colwise" else "out_features"), out_f


ALLOWS_UNEVEN = ("vocab_embedding", "vocab_colwise")
"""Vocabulary shards may be uneven (GPT-2's 50257 rows at TP=4): DTensor keeps the global shape
exact, so no padding ever reaches logits, losses or state dicts."""
