"""``DistributedModel``: wraps a Hugging Face model, shards it in place, keeps HF's interface.

Its backward pass and data-parallel gradient average are in ``model_grads``, its tensor-parallel
queries in ``model_tp`` (mixins).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import runtime
from . import partitioning
from .materialize import weights
from .training import batch
from .training.dp import OverlappedAverage
from .model_grads import GradientAveraging
from .model_tp import TensorParallelMethods
from .materialize.state_dict import LoadReport, full_state_dict, load_state_dict, local_state_dict
from .parallelize import check

class DistributedModel(GradientAveraging, TensorParallelMethods, nn.Module):
    """A model sharded over the runtime's tensor-parallel mesh (SageMaker's ``smp.DistributedModel``).

    The wrapped model computes the same function as before wrapping: pretrained weights are kept,
    each rank holding its shard. Attributes the wrapper does not define (``generate``,
    ``config``...) are looked up on the wrapped model, available as ``.module``.

    Args:
        module: the model; modules marked with ``tensor_parallelism(enabled=False)`` stay whole.
            Built on the meta device it is sharded without allocating anything (load it with
            ``smp.load_hf_checkpoint``, or build it in ``smp.delay_param_initialization()`` to
            initialize each rank's shard); real on rank 0 only and meta elsewhere, each rank
            receives its shards of rank 0's weights.
        backward_passes_per_step: gradients are averaged over data-parallel replicas once every
            this many steps (``@smp.step`` calls, or ``backward`` calls outside a step); in
            between they accumulate locally.
        average_grads_across_microbatches: scale each microbatch's gradient by 1/microbatches
            (True, for a loss that is a mean) or sum them (False, for a summed loss).
        trace_device, trace_execution_times, trace_memory_usage: accepted, no effect (there is
            no tracing step).
        overlapping_allreduce: average gradients over data-parallel replicas in buckets launched
            during the backward pass that ends a step (True), or after it (False).
        bucket_cap_mb: the largest such bucket, in MiB of gradients.
        gradient_as_bucket_view: accepted, no effect: buckets are copies, the gradients stay
            the parameters' own tensors.
        broadcast_buffers: accepted, no effect: every rank builds the same buffers (same seed,
            or rank 0's weights sent to every rank) and no data-dependent buffer update is
            synchronized.

    Raises:
        ValueError: if the model was already wrapped, or its plan does not fit (before any
            tensor is touched).
    """

    def __init__(self, module: nn.Module, trace_device: str = "gpu", trace_execution_times: bool = False,
                 overlapping_allreduce: bool = True, backward_passes_per_step: int = 1,
                 average_grads_across_microbatches: bool = True, bucket_cap_mb: float = 25,
                 trace_memory_usage: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False):
        _check_v1_args(trace_device, backward_passes_per_step)
        if isinstance(module, DistributedModel) or module.__dict__.get("_mp_wrapped"):
            raise ValueError("DistributedModel was already applied to this model; wrap a model once")
        rt = runtime.current()
        check(module, rt.topology)  # what no plan can fix is refused before the first collective
        super().__init__()
        self._mp_topology = rt.topology  # where the (possibly deferred) split runs
        self._mp_state = self._mp_pipeline = None  # set by partitioning.shard
        self._v1 = V1Options(backward_passes_per_step, average_grads_across_microbatches, overlapping_allreduce,
                             bucket_cap_mb)
        self._mp_optimizers: list = []  # DistributedOptimizers holding this model's parameters, newest last
        self._mp_names = partitioning.wait_for_marks(module) if partitioning.deferred(rt.topology) else {}
        if not partitioning.deferred(rt.topology):
            partitioning.shard(self, module, rt.topology)
        module._mp_wrapped = True
        self.module = module
        rt.models.append(self)
        if rt.pending_resume is not None:  # smp.resume_from_checkpoint ran before this model existed
            self._mp_partition_now()
            rt.pending_resume.on_model(self)

    def _mp_partition_now(self) -> None:
        """Split the model now if it waits for the user's partition marks (a collective)."""
        partitioning.ensure(self)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def forward(self, *args, **kwargs):
        """Run the wrapped model. With ``prescaled_batch`` false and TP > 1, the TP group
        computes on the union of its ranks' batches and each rank gets its own rows back."""
        self._mp_partition_now()
        weights.check_ready(self.module, self._mp_state)
        rt = runtime.current()
        if not rt.config.scaled_batch:
            return self.module(*args, **kwargs)
        args, kwargs, rows = batch.enter(args, kwargs, rt.group(runtime.TP_GROUP))
        return batch.exit(self.module(*args, **kwargs), rows)
    @property
    def partitioned(self) -> bool:
        """SageMaker's flag: True once the first ``@smp.step`` call has started (the shards
        themselves exist from construction on)."""
        return self._v1.steps > 0

    def _before_step(self) -> None:
        self._mp_partition_now()
        self._v1.steps += 1
        if self._v1.steps == 1:
            for hook in list(self._v1.post_partition_hooks.values()):
                hook(self, self._optimizer())

    def _after_step(self) -> None:
        if self._v1.steps == 1 and self._v1.post_step_hooks:
            hooks = list(self._v1.post_step_hooks.values())
            self._v1.post_step_hooks.clear()
            for hook in hooks:
                hook(self, self._optimizer())

    def register_post_partition_hook(self, hook) -> RemovableHandle | None:
        """Run ``hook(model, optimizer)`` at the first ``@smp.step`` call, before its first
        forward; if that call already happened, run it now."""
        if self.partitioned:
            hook(self, self._optimizer())
            return None
        handle = RemovableHandle(self._v1.post_partition_hooks)
        self._v1.post_partition_hooks[handle.id] = hook
        return handle

    def register_post_step_hook(self, hook) -> RemovableHandle | None:
        """Run ``hook(model, optimizer)`` once, after the first ``@smp.step`` call completes; if
        it already did (and an optimizer exists), run it now."""
        if self.partitioned and self._optimizer() is not None:
            hook(self, self._optimizer())
            return None
        handle = RemovableHandle(self._v1.post_step_hooks)
        self._v1.post_step_hooks[handle.id] = hook
        return handle

    def link_optimizer(self, optimizer) -> None:
        """Record a ``DistributedOptimizer`` holding some of this model's parameters (it calls
        this when built): the newest one's loss scale scales ``backward`` and hooks receive it."""
        if optimizer not in self._mp_optimizers:
            self._mp_optimizers.append(optimizer)

    @property
    def linked_optimizers(self) -> tuple:
        """The ``DistributedOptimizer``s holding this model's parameters, newest last."""
        return tuple(self._mp_optimizers)

    def _optimizer(self):
        return self._mp_optimizers[-1] if self._mp_optimizers else None

    def get_module(self) -> nn.Module:
        """The wrapped model (SageMaker's name for ``.module``)."""
        return self.module

    def state_dict(self, gather_to_rank0: bool = False, **_) -> dict[str, torch.Tensor]:
        """The full state dict at global shapes, every pipeline stage's entries included (a
        collective). With ``gather_to_rank0`` only rank 0 receives it and other ranks get ``{}``."""
        self._mp_partition_now()
        weights.check_ready(self.module, self._mp_state)
        pp_group = runtime.current().group(runtime.PP_GROUP) if self._mp_pipeline is not None else None
        return full_state_dict(self.module, gather_to_rank0, pp_group)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, keyed like ``state_dict()``."""
        self._mp_partition_now()
        weights.check_ready(self.module, self._mp_state)
        return local_state_dict(self.module)

    def load_state_dict(self, state_dict, same_partition_load: bool = False, strict: bool = True) -> LoadReport:
        """Load a full state dict (any TP degree saved it) or this rank's local one.

        ``same_partition_load=True`` takes the fast path for a local state dict saved with the
        same layout and raises if the layout differs. Waits for an asynchronous save still
        copying the parameters first.
        """
        from .checkpoint.api import wait_for_staging

        wait_for_staging()
        self._mp_partition_now()
        return load_state_dict(self.module, state_dict, strict=strict, same_partition_load=same_partition_load)

    def local_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters held by this rank (sharded ones as DTensors holding the local shard)."""
        self._mp_partition_now()
        return self.module.parameters()

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def local_buffers(self) -> Iterator[torch.Tensor]:
        """Buffers held by this rank (every module lives on every rank of a TP group)."""
        return self.module.buffers()

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers()

    def local_modules(self) -> Iterator[nn.Module]:
        return self.module.modules()

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules()


@dataclass
class V1Options:
    """SageMaker v1 ``DistributedModel`` arguments that change behaviour, and step bookkeeping."""

    backward_passes_per_step: int = 1
    average_grads_across_microbatches: bool = True
    overlapping_allreduce: bool = True
    bucket_cap_mb: float = 25
    overlap: list[OverlappedAverage] | None = None  # one per replica group, made at the first pass they serve
    passes: int = 0
    steps: int = 0
    post_step_hooks: OrderedDict = field(default_factory=OrderedDict)  # weakly referenced by handles
    post_partition_hooks: OrderedDict = field(default_factory=OrderedDict)


def _check_v1_args(trace_device: str, backward_passes_per_step: int) -> None:
    if trace_device not in ("cpu", "gpu"):
        raise ValueError(f"trace_device must be 'cpu' or 'gpu', got {trace_device!r}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
