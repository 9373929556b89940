"""Vocabulary-parallel embedding whose weight gradient stays a shard.

PyTorch's ``RowwiseParallel`` on ``nn.Embedding`` runs the lookup as a DTensor op; its backward
computes ``embedding_dense_backward`` at the full [vocabulary, hidden] size on every rank and
leaves the weight's gradient Partial, full size, until the optimizer redistributes it. For a
128k-token vocabulary that is a whole extra copy of the table per rank. Megatron's
vocab-parallel embedding avoids it, and so does this one: each rank looks up only the ids in its
row range (others give zeros), one all-reduce sums the partial outputs, and the backward is a
local embedding backward into the rank's own rows: the gradient is a Shard(0) DTensor of the
shard's size, with no communication.

Shards follow DTensor's ``Shard(0)`` rule (``torch.chunk``: the first ranks get the ceiling), so
uneven vocabularies (50257 at TP=4) need no padding.

An HF subclass of ``nn.Embedding`` that wraps the lookup (Gemma's scaled word embedding
multiplies ``super().forward(ids)`` by ``sqrt(hidden)``) keeps its own forward: the sharded lookup
becomes the ``super()`` it calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from .layout import shard_range


class _SumAcrossRanks(torch.autograd.Function):
    """All-reduce (sum) of partial lookups; the output is used alike on every rank, so its
    gradient is already the replicated gradient each rank's partial output needs."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``weight`` is a ``Shard(0)`` DTensor over the vocabulary."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight: DTensor = self.weight
        mesh = weight.device_mesh
        start, end = shard_range(self.num_embeddings, mesh.size(), mesh.get_local_rank())
        inside = (ids >= start) & (ids < end)
        local_ids = torch.where(inside, ids - start, 0)
        pad = self.padding_idx - start if self.padding_idx is not None and start <= self.padding_idx < end else None
        partial = F.embedding(local_ids, weight.to_local(), pad, None, 2.0, self.scale_grad_by_freq, False)
        partial = partial * inside.unsqueeze(-1).to(partial.dtype)
        return _SumAcrossRanks.apply(partial, mesh.get_group())


_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    """The class a sharded ``cls`` instance takes: ``_VocabParallelEmbedding`` for a plain
    ``nn.Embedding``; for a subclass, one that keeps the subclass's methods with the sharded lookup
    below them (MRO: subclass, then ``_VocabParallelEmbedding``), so its ``super().forward`` runs it."""
    if cls is nn.Embedding or cls is _VocabParallelEmbedding or issubclass(cls, _VocabParallelEmbedding):
        return _VocabParallelEmbedding if cls is nn.Embedding else cls
    if cls not in _CLASSES:
        name = f"VocabParallel_{cls.__name__}_{len(_CLASSES)}"
        new = type(name, (cls, _VocabParallelEmbedding), {"__module__": __name__, "__qualname__": name})
        globals()[name] = new  # importable by name, so pickling the module works
        _CLASSES[cls] = new
    return _CLASSES[cls]


class VocabParallelEmbedding(ParallelStyle):
    """The ``vocab_embedding`` style: rows sharded, lookups masked, one forward all-reduce."""

    src_data_rank = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise NotImplementedError(f"vocab_embedding shards nn.Embedding, not {type(module).__name__}")
        if module.max_norm is not None or module.sparse:
            raise NotImplementedError(f"vocab_embedding with max_norm={module.max_norm}, sparse={module.sparse}")
        weight = module.weight
        if isinstance(weight, DTensor) and tuple(weight.placements) != (Shard(0),):
            raise ValueError(f"vocab_embedding: the weight is already distributed as {weight.placements}")
        if not isinstance(weight, DTensor):  # a tie may have distributed it already (same placements)
            weight = nn.Parameter(distribute_tensor(weight.detach(), device_mesh, [Shard(0)],
                                                    src_data_rank=self.src_data_rank),
                                  requires_grad=module.weight.requires_grad)
        module.register_parameter("weight", weight)
        if not getattr(type(module), "vocab_parallel_forward", False):  # else its own forward handles shards
            module.__class__ = _sharded_class(type(module))
        return module
