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

from . import runtime
from .tp.modules import DistributedModule


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
        """True when the TP group computes on the union of its ranks' batches
        (``prescaled_batch`` false, TP > 1): then every parameter sees the scaled batch."""
        return _scaled_batch()

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        """As ``is_scaled_batch_parameter``."""
        return _scaled_batch()

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, param)`` of the parameters on the local batch (gradients identical over the
        TP group, averaged over the replicas): all of them unless the batch is scaled."""
        return iter(()) if _scaled_batch() else self.module.named_parameters()

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, param)`` of the parameters on the TP group's union batch, reduced over
        RDP_GROUP: all of them when the batch is scaled, else none."""
        return self.module.named_parameters() if _scaled_batch() else iter(())


def _scaled_batch() -> bool:
    return runtime.current().config.scaled_batch
