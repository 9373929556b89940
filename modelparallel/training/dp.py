"""Data parallelism without sharding: average gradients over the data-parallel group.

Gradients are flattened into one buffer per dtype so a step costs one all-reduce per dtype
rather than one per parameter (the bucketing idea of PyTorch DDP, Li et al. 2020); ``OverlappedAverage``
launches those buckets during the backward pass instead of after it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..tp.layout import local_grad, local_part


def allreduce_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """Average the gradients of ``params`` over ``group`` (``size`` ranks), in place."""
    if size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        g = local_grad(p)
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    """``params`` cut into consecutive buckets of one dtype and at most ``cap_bytes`` (a larger
    parameter gets a bucket of its own)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = local_part(p).numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class OverlappedAverage:
    """The same average over the data-parallel group, in buckets launched during the backward
    pass: a bucket's all-reduce starts as soon as autograd has accumulated all of its gradients,
    while earlier layers are still back-propagating (the overlap of PyTorch DDP, Li et al. 2020).

    Buckets hold the parameters in reverse order (the last layers' gradients are ready first) and
    launch strictly in bucket order, a ready bucket waiting for the ones before it, so every rank
    issues the same collectives in the same order whatever order its hooks fire in. A bucket with
    a parameter that gets no gradient in the pass launches at ``finish``, and so do the buckets
    after it (the average is the same, only the overlap is lost).

    Args:
        params: the model's parameters (those without ``requires_grad`` are left out).
        group, size: the data-parallel process group and its size.
        bucket_cap_mb: the largest bucket, in MiB of gradients.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, size: int,
                 bucket_cap_mb: float):
        params = [p for p in params if p.requires_grad]
        self.group, self.size = group, size
        self.buckets = _buckets(params[::-1], int(bucket_cap_mb * 2**20))
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.armed = False
        self._ready: list[int] = []
        self._launched: list[tuple] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """The next backward pass ends with the average: launch buckets as they fill."""
        self.armed, self._ready, self._launched = True, [0] * len(self.buckets), []

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        self._ready[self._bucket_of[id(p)]] += 1
        while len(self._launched) < len(self.buckets):
            i = len(self._launched)
            if self._ready[i] < len(self.buckets[i]):
                return
            self._launch(i)

    def _launch(self, i: int) -> None:
        grads = [g for g in (local_grad(p) for p in self.buckets[i]) if g is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else None
        work = dist.all_reduce(flat, group=self.group, async_op=True) if flat is not None else None
        self._launched.append((grads, flat, work))

    def finish(self, apply: bool = True) -> None:
        """Launch the buckets still waiting, wait for all, and (``apply``) write the averages into
        the gradients; ``apply=False`` drops them (the pass is averaged another way)."""
        while len(self._launched) < len(self.buckets):
            self._launch(len(self._launched))
        for grads, flat, work in self._launched:
            if work is not None:
                work.wait()
            if apply and flat is not None:
                flat.div_(self.size)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
        self.armed, self._launched = False, []
