"""``DistributedModel``'s tensor-parallel queries (SageMaker's ``distributed_modules()``,
``is_distributed_parameter()`` ...), as a mixin over ``self.module``.

Here every rank of a tensor-parallel group reads the same batch (Megatron's layout), so no
parameter works on a batch scaled over the group: the scaled-batch queries answer False / empty
and every parameter's gradient is averaged over the data-parallel group (the default reducer).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .nn.distributed.base import DistributedModule


def _sharded(t: torch.Tensor | None) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


def _holds_shards(module: nn.Module, recurse: bool) -> bool:
    tensors = list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse))
    return any(_sharded(t) for t in tensors)


class TensorParallelMethods:
    """Mixed into ``DistributedModel`` (which holds the wrapped model as ``self.module``)."""

    def distributed_modules(self) -> Iterator[nn.Module]:
        """The tensor-parallelized modules: each outermost ``smp.nn`` distributed module holding
        shards, and every other module whose own parameters or buffers are sharded."""
        inside: set[int] = set()
        for module in self.module.modules():
            if id(module) in inside:
                continue
            if isinstance(module, DistributedModule) and _holds_shards(module, True):
                inside.update(id(m) for m in module.modules())
                yield module
            elif _holds_shards(module, False):
                yield module

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """True if ``param`` is split over the tensor-parallel ranks (each holds a shard)."""
        return _sharded(param)

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        """True if ``buf`` is split over the tensor-parallel ranks."""
        return _sharded(buf)

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        """False: tensor-parallel ranks read the same batch, none is scaled over the group."""
        return False

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        """False, as ``is_scaled_batch_parameter``."""
        return False

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, param)`` of the parameters whose gradients are averaged over DP_GROUP: all."""
        return self.module.named_parameters()

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, param)`` of the parameters reduced over RDP_GROUP for a scaled batch: none."""
        return iter(())
