"""The tensor-parallel group's union batch (``prescaled_batch`` false).

Each rank of a TP group brings its own batch. At the model's entry the group gathers the batch
tensors along axis 0 (rank order), so every rank of the group computes on the same union batch;
at the exit each rank takes back the rows of its own batch. The exit's backward gathers every
rank's output gradient and divides it by the group size, so the gradient every rank of the group
back-propagates is the gradient of the mean of the group's losses: averaged once more over the
reduced-data-parallel group, it is the gradient of the mean loss over all ranks' batches. The
entry's backward keeps this rank's rows (the union's gradient is the same on every TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compat import all_gather_single


@dataclass(frozen=True)
class Rows:
    """Where each TP rank's rows sit in the union batch."""

    sizes: tuple[int, ...]
    index: int
    group: Any

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def start(self) -> int:
        return sum(self.sizes[:self.index])


def _gather_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Concatenate every rank's ``x`` along axis 0 (sizes may differ; padded to the largest)."""
    most = max(rows.sizes)
    if x.shape[0] < most:
        x = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((most * len(rows.sizes), *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=rows.group)
    return torch.cat([out[i * most:i * most + n] for i, n in enumerate(rows.sizes)])


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows):
        ctx.rows = rows
        return _gather_rows(x, rows)

    @staticmethod
    def backward(ctx, grad):
        r = ctx.rows
        return grad[r.start:r.start + r.sizes[r.index]], None


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows):
        ctx.rows = rows
        return y[rows.start:rows.start + rows.sizes[rows.index]].clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad.contiguous(), ctx.rows) / len(ctx.rows.sizes), None


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    return None


def enter(args: tuple, kwargs: dict, group: dist.ProcessGroup) -> tuple[tuple, dict, Rows | None]:
    """Replace the batch tensors of a model call by the TP group's union.

    The batch size is axis 0 of the first tensor argument; every tensor argument with that axis-0
    size is gathered, others (and non-tensors) pass unchanged and must be the same on every rank.

    Returns:
        The new args and kwargs, and the row layout ``exit`` needs (None if nothing was gathered).

    Raises:
        ValueError: on every rank alike, naming the argument, if the ranks' batch tensors differ
            in anything but axis 0.
    """
    b = _batch_size(args, kwargs)
    if b is None:
        return args, kwargs, None
    names = [f"argument {i}" for i in range(len(args))] + [f"argument {k!r}" for k in kwargs]
    values = [*args, *kwargs.values()]
    picked = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b]
    shapes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shapes, [tuple(values[i].shape) for i in picked], group=group)
    for j, i in enumerate(picked):
        rest = {s[j][1:] if j < len(s) else None for s in shapes}
        if len(rest) != 1:
            raise ValueError(f"prescaled_batch=False: the tensor-parallel ranks' {names[i]} differ beyond the "
                             f"batch axis ({[s[j] if j < len(s) else None for s in shapes]}); every TP rank "
                             "must bring batches of the same shape apart from the batch size")
    rows = Rows(tuple(s[0][0] for s in shapes), dist.get_rank(group), group)
    for i in picked:
        values[i] = _Enter.apply(values[i], rows)
    return tuple(values[:len(args)]), dict(zip(kwargs, values[len(args):])), rows


def exit(outputs: Any, rows: Rows | None) -> Any:
    """Give back this rank's rows of every output tensor whose axis 0 is the union batch.

    A model's scalar loss, computed on the union, is returned as is. So is a DTensor output
    (the vocabulary-sharded logits a model keeps when it computed its loss): each rank holds a
    slice of every row, so taking one rank's rows would need the full logits gathered first,
    the cost the sharded loss exists to avoid; it covers the union batch, in TP rank order.
    """
    if rows is None:
        return outputs
    if isinstance(outputs, DTensor):
        return outputs
    if isinstance(outputs, torch.Tensor):
        return _Exit.apply(outputs, rows) if outputs.dim() > 0 and outputs.shape[0] == rows.total else outputs
    if isinstance(outputs, dict):  # includes Hugging Face ModelOutput, updated in place
        for k in list(outputs.keys()):
            outputs[k] = exit(outputs[k], rows)
        return outputs
    if isinstance(outputs, (list, tuple)) and not hasattr(outputs, "_fields"):
        return type(outputs)(exit(o, rows) for o in outputs)
    return outputs
