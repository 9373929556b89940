"""``DistributedModel``'s backward pass and data-parallel gradient average, as a mixin: the loss
scale and 1/microbatches applied to ``backward``, SageMaker v1's ``backward_passes_per_step``
window, and the average over each kind of replica (buckets overlapped with the backward pass, or
after it).

Kept apart from ``model.py`` (wrapping, forward, state dicts, hooks) because this is the one place
gradients are scaled and reduced; it reads the host's ``_v1`` options, ``_mp_state``,
``_mp_pipeline`` and ``_optimizer()``.
"""

from __future__ import annotations

import torch
from torch import nn

from . import runtime
from .expert import is_expert_parameter
from .training.dp import OverlappedAverage, allreduce_gradients


class GradientAveraging:
    """``backward`` and the data-parallel average for ``DistributedModel``."""

    def backward(self, tensors, grad_tensors=None) -> None:
        """Backpropagate like ``torch.autograd.backward(tensors, grad_tensors)``, scaled by the
        optimizer's loss scale (if any) and, inside ``@smp.step``, by 1/microbatches; then
        average gradients over data-parallel replicas (inside a step: once, after its last
        microbatch; every ``backward_passes_per_step`` steps)."""
        rt = runtime.current()
        optimizer = self._optimizer()
        scale = optimizer.loss_scaler.loss_scale if optimizer is not None else 1.0
        if rt.step is not None and self._v1.average_grads_across_microbatches:
            scale /= rt.step.num_microbatches
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
            grad_tensors = [grad_tensors] * (1 if grad_tensors is not None else len(tensors))
        grads = [None if g is None else g * scale for g in grad_tensors]
        if scale != 1.0:
            tensors = [t * scale if g is None else t for t, g in zip(tensors, grads)]
        if self._mp_pipeline is not None:  # the pipeline schedule back-propagates it later
            return self._mp_pipeline.record_backward(tensors, grads)
        self._arm_overlap(rt)
        torch.autograd.backward(tensors, grads)
        if rt.step is None:
            self._finish_backward()
        elif self not in rt.step.models:
            rt.step.models.append(self)

    def _finish_backward(self) -> bool:
        """One backward pass (or step) done: average gradients when ``backward_passes_per_step``
        says so. Returns whether the gradients are final (the end of such a window)."""
        rt = runtime.current()
        self._v1.passes += 1
        if self._v1.passes % self._v1.backward_passes_per_step:
            return False
        if not self._averages(rt):
            return True
        if self._v1.overlap and self._v1.overlap[0].armed:
            for average in self._v1.overlap:
                average.finish()
        else:
            for params, group, size in self._replica_groups(rt):
                allreduce_gradients(params, group, size)
        return True

    def _replica_groups(self, rt) -> list[tuple[list[nn.Parameter], object, int]]:
        """(parameters, process group, its size) for each kind of replica: the experts of an
        expert-parallel model are replicated over the ranks holding the same experts (expert
        data x context parallel ranks), every other parameter over the data x context parallel ranks. Groups of one rank are left out."""
        params = list(self.module.parameters())
        experts = [p for p in params if is_expert_parameter(p)]
        groups = [([p for p in params if not is_expert_parameter(p)], rt.group(runtime.DP_CP_GROUP),
                   rt.config.replica_degree)]
        if experts:
            replicas = rt.expert_replica_mesh
            groups.append((experts, replicas.get_group(), replicas.size()))
        return [g for g in groups if g[2] > 1]

    def _averages(self, rt) -> bool:
        """Whether this model's gradients are averaged over data-parallel replicas (and context
        ranks, which hold the same parameters) here (FSDP reduce-scatters them itself)."""
        return rt.config.ddp and not self._mp_state.fsdp and rt.config.replica_degree > 1

    def _arm_overlap(self, rt) -> None:
        """Before a backward pass that ends with the data-parallel average (the last microbatch
        of a step whose pass count averages), let its buckets launch during the pass. A second
        backward in that same microbatch cancels it: its gradients would come after the launch,
        so that step averages after the backward instead."""
        v1 = self._v1
        if not (v1.overlapping_allreduce and self._averages(rt)):
            return
        if v1.overlap and v1.overlap[0].armed:
            for average in v1.overlap:
                average.finish(apply=False)
            return
        last = rt.step is None or rt.step.microbatch == rt.step.num_microbatches - 1
        if not last or (v1.passes + 1) % v1.backward_passes_per_step:
            return
        if v1.overlap is None:
            v1.overlap = [OverlappedAverage(params, group, size, v1.bucket_cap_mb)
                          for params, group, size in self._replica_groups(rt)]
        for average in v1.overlap:
            average.arm()
