"""``@smp.step``: run a forward/backward function once per microbatch and accumulate gradients.

The decorated function's tensor arguments are split along their batch axis (0 unless
``input_split_axes`` says otherwise) into ``microbatches`` equal pieces; the function runs on each
piece in turn, each ``model.backward`` inside it adding that microbatch's gradients (scaled by
1/microbatches unless the model was built with ``average_grads_across_microbatches=False``), and
the data-parallel gradient average runs once, after the last microbatch. Every tensor the
function returns comes back as a ``StepOutput`` holding one tensor per microbatch.

With one microbatch the function runs once on the arguments as given: the cost over a plain
loop is a signature bind and the final gradient average, which a plain loop pays too.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import runtime


class StepOutput:
    """Every microbatch's version of one tensor returned from an ``@smp.step`` function."""

    def __init__(self, outputs: list[torch.Tensor]):
        self.outputs = list(outputs)
        """The tensors, indexed by microbatch."""

    def reduce_mean(self) -> torch.Tensor:
        """The element-wise mean over microbatches (e.g. the batch's mean loss)."""
        return torch.stack(self.outputs).mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        return torch.stack(self.outputs).sum(dim=0)

    def concat(self) -> torch.Tensor:
        """The microbatches' tensors joined along the batch axis (e.g. the batch's predictions)."""
        return torch.cat(self.outputs, dim=0)

    def stack(self) -> torch.Tensor:
        return torch.stack(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({len(self.outputs)} microbatches)"


@dataclass
class StepContext:
    """What ``DistributedModel.backward`` needs to know while a step runs."""

    num_microbatches: int
    microbatch: int = 0
    models: list = field(default_factory=list)
    """Models whose ``backward`` ran in this step: their gradients are reduced at its end."""


def num_microbatches() -> int:
    """The configured number of microbatches per ``@smp.step`` call."""
    return runtime.current().config.microbatches


def is_tracing() -> bool:
    """Always False: no tracing step exists here (SageMaker traces during the first step)."""
    return False


def step(func: Callable | None = None, *, non_split_inputs: list[str] | None = None,
         input_split_axes: dict[str, int] | None = None, detach_outputs: bool = True):
    """Decorate a function holding one forward and backward pass (``@smp.step`` or ``@smp.step(...)``).

    Args:
        func: the function (when used as a bare decorator).
        non_split_inputs: argument names passed whole to every microbatch.
        input_split_axes: argument name -> the axis to split it on (default 0).
        detach_outputs: detach returned tensors so the step's graph is freed.

    Returns:
        The wrapped function; it returns what ``func`` returns with every tensor replaced by a
        ``StepOutput``.

    Raises:
        ValueError: if ``non_split_inputs`` or ``input_split_axes`` name an argument ``func``
            does not have; at call time, if a split size is not divisible by the microbatches.
    """
    def decorate(f: Callable) -> Callable:
        sig = inspect.signature(f)
        for kind, names in (("non_split_inputs", non_split_inputs or []), ("input_split_axes", input_split_axes or {})):
            missing = [n for n in names if n not in sig.parameters]
            if missing:
                raise ValueError(f"smp.step({kind}=...) names {missing}, which {f.__qualname__}"
                                 f"{sig} has no argument for")
        splitter = _Splitter(sig, set(non_split_inputs or ()), dict(input_split_axes or {}))

        @functools.wraps(f)
        def run(*args, **kwargs):
            return _run(f, splitter, args, kwargs, detach_outputs)

        return run

    return decorate(func) if func is not None else decorate


def _run(f: Callable, splitter: _Splitter, args: tuple, kwargs: dict, detach: bool):
    rt = runtime.current()
    n = rt.config.microbatches
    pipeline = _pipeline(rt)
    if pipeline is not None:
        args, kwargs = pipeline.inputs(args, kwargs)
    pieces = splitter.split(args, kwargs, n)
    for model in rt.models:
        model._before_step()
    ctx = StepContext(num_microbatches=n)
    rt.step = ctx
    try:
        results = _microbatches(f, pieces, ctx, rt)
    finally:
        rt.step = None
    for model in ctx.models:
        model._finish_backward()
    for model in rt.models:
        model._after_step()
    return _collect(results, detach)


def _pipeline(rt):
    """The pipeline runner of the newest pipelined model, or None."""
    pipelined = [m._mp_pipeline for m in rt.models if getattr(m, "_mp_pipeline", None) is not None]
    return pipelined[-1] if pipelined else None


def _microbatches(f: Callable, pieces: list, ctx: StepContext, rt) -> list:
    """``f``'s result on every microbatch: one after the other, or through the pipeline stages
    of the (newest) pipelined model, which then also averages its gradients."""
    pipeline = _pipeline(rt)
    if pipeline is not None:
        return pipeline.run(f, pieces, ctx)
    results = []
    for i, (a, kw) in enumerate(pieces):
        ctx.microbatch = i
        results.append(f(*a, **kw))
    return results


def _collect(results: list, detach: bool):
    """Turn per-microbatch return values into one structure of ``StepOutput``s."""
    first = results[0]
    if isinstance(first, torch.Tensor):
        return StepOutput([r.detach() if detach else r for r in results])
    if isinstance(first, dict):
        return type(first)((k, _collect([r[k] for r in results], detach)) for k in first)
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        return type(first)(_collect(list(parts), detach) for parts in zip(*results))
    if isinstance(first, tuple):  # a named tuple
        return type(first)(*(_collect(list(parts), detach) for parts in zip(*results)))
    return first


class _Splitter:
    """Splits a call's arguments into per-microbatch argument lists."""

    def __init__(self, sig: inspect.Signature, whole: set[str], axes: dict[str, int]):
        self.sig, self.whole, self.axes = sig, whole, axes

    def split(self, args: tuple, kwargs: dict, n: int) -> list[tuple[tuple, dict]]:
        if n == 1:
            return [(args, kwargs)]
        bound = self.sig.bind(*args, **kwargs)
        per_mb = [dict() for _ in range(n)]
        for name, value in bound.arguments.items():
            if name in self.whole:
                parts = [value] * n
            else:
                parts = [_slice(value, n, i, self.axes.get(name, 0), name) for i in range(n)]
            for i in range(n):
                per_mb[i][name] = parts[i]
        out = []
        for values in per_mb:
            b = inspect.BoundArguments(self.sig, values)
            out.append((b.args, b.kwargs))
        return out


def _slice(value: Any, n: int, i: int, axis: int, name: str) -> Any:
    """Microbatch ``i`` of ``n`` of one argument (tensors and containers of them split; objects
    with an ``smp_slice(num_mb, mb, axis)`` method slice themselves; anything else is shared)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        size = value.shape[axis]
        if size % n:
            raise ValueError(f"smp.step: argument {name!r} has size {size} along axis {axis}, which "
                             f"{n} microbatches do not divide (shape {tuple(value.shape)})")
        return value.narrow(axis, i * (size // n), size // n)
    if hasattr(value, "smp_slice"):
        return value.smp_slice(n, i, axis)
    if isinstance(value, dict):
        return type(value)((k, _slice(v, n, i, axis, f"{name}[{k!r}]")) for k, v in value.items())
    if isinstance(value, (list, tuple, set)) and not hasattr(value, "_fields"):
        return type(value)(_slice(v, n, i, axis, f"{name}[{j}]") for j, v in enumerate(value))
    if isinstance(value, tuple):
        return type(value)(*(_slice(v, n, i, axis, f"{name}.{j}") for j, v in enumerate(value)))
    return value
