"""Which blocks each pipeline stage runs: balanced by cost, or as the user's marks say.

Automatic partitioning (``auto_partition`` true) gives each stage a contiguous range of blocks
(with virtual stages, each of the ``P x V`` stages).
A block's cost is its parameter count: memory, and for a transformer block also its compute
(each weight is used in one multiply-add per token). The ranges minimize, in this order, the
largest stage's block cost, then maximize the smallest one (so uniform blocks end up within one
block of even), then minimize the sum of squared stage costs counting the stage's own other
modules (embeddings on the first stage, final norm and head on the last): the stages that also
hold those get the fewer blocks when the count does not divide evenly.

Manual partitioning (``auto_partition`` false) reads ``smp.partition`` / ``smp.set_partition``
marks on the blocks (``default_partition`` for unmarked ones); they must name every stage, in
order, as contiguous runs.
"""

from __future__ import annotations

import math

from torch import nn

from .marks import partition_of

Ranges = tuple[tuple[int, int], ...]


def param_count(module: nn.Module) -> int:
    """Parameters of ``module`` (meta tensors count; a tied tensor once)."""
    return sum(p.numel() for p in module.parameters())


def _best(costs: list[int], count: int, ok, score, combine, better) -> tuple[float, list[int]] | None:
    """Dynamic programme over cut points: the best ``combine``d ``score`` of splitting ``costs``
    into ``count`` non-empty contiguous runs whose run costs satisfy ``ok(stage, cost)``.
    Returns (value, run ends) or None."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best: dict[tuple[int, int], tuple[float, list[int]]] = {(0, 0): (None, [])}
    for k in range(1, count + 1):
        for i in range(k, n - (count - k) + 1):
            for j in range(k - 1, i):
                prev = best.get((k - 1, j))
                cost = prefix[i] - prefix[j]
                if prev is None or not ok(k - 1, cost):
                    continue
                value = score(k - 1, cost) if prev[0] is None else combine(prev[0], score(k - 1, cost))
                if (k, i) not in best or better(value, best[(k, i)][0]):
                    best[(k, i)] = (value, prev[1] + [i])
    return best.get((count, n))


def balanced(costs: list[int], count: int, first: int = 0, last: int = 0) -> Ranges:
    """Contiguous ranges of ``costs`` (block costs) for ``count`` stages, balanced as the module
    docstring says; ``first`` / ``last`` are the first and last stage's other costs."""
    lt = lambda a, b: a < b
    gt = lambda a, b: a > b
    top, _ = _best(costs, count, lambda s, c: True, lambda s, c: c, max, lt)
    low, _ = _best(costs, count, lambda s, c: c <= top, lambda s, c: c, min, gt)
    extra = lambda s: (first if s == 0 else 0) + (last if s == count - 1 else 0)
    _, ends = _best(costs, count, lambda s, c: low <= c <= top, lambda s, c: (c + extra(s)) ** 2,
                    lambda a, b: a + b, lt)
    starts = [0] + ends[:-1]
    return tuple(zip(starts, ends))


def check_count(n_blocks: int, count: int, what: str, virtual: int = 1) -> None:
    """Raise if ``count x virtual`` stages cannot each get a block."""
    if count * virtual > n_blocks:
        stages = f"pipeline_parallel_degree {count}" if virtual == 1 else \
            f"pipeline_parallel_degree {count} x pipeline_virtual_stages {virtual} = {count * virtual} stages"
        raise ValueError(f"{stages} is more than the {n_blocks} layers of {what}: every "
                         "pipeline stage needs at least one layer")


def manual(model: nn.Module, block_path: str, n_blocks: int, count: int, default: int) -> Ranges:
    """The ranges the blocks' partition marks describe.

    Raises:
        ValueError: naming the block whose partition is out of range or out of order, or the
            partitions that get no block.
    """
    parts, problems = [], []
    for i in range(n_blocks):
        index, _ = partition_of(model, f"{block_path}.{i}", default)
        if index >= count:
            problems.append(f"{block_path}.{i} is on partition {index}, but pipeline_parallel_degree is {count}")
        elif parts and index < parts[-1]:
            problems.append(f"{block_path}.{i} is on partition {index} after {block_path}.{i - 1} on partition "
                            f"{parts[-1]}: partitions must hold contiguous layers, in order")
        parts.append(index)
    empty = sorted(set(range(count)) - set(parts))
    if empty and not problems:
        problems.append(f"partitions {empty} get no layer ({block_path}: {parts}); every pipeline stage "
                        "needs at least one")
    if problems:
        raise ValueError("invalid manual pipeline partition (auto_partition false):\n  - " + "\n  - ".join(problems))
    return tuple((parts.index(s), len(parts) - parts[::-1].index(s)) for s in range(count))


def ignored_marks(model: nn.Module) -> list[str]:
    """Paths of modules carrying partition marks (for the log line when ``auto_partition``
    ignores them)."""
    return [path or type(model).__name__ for path, m in model.named_modules() if "_mp_partition" in m.__dict__]


def imbalance(costs: list[int], ranges: Ranges) -> float:
    """Largest stage cost over the mean (1.0: perfectly even)."""
    totals = [sum(costs[lo:hi]) for lo, hi in ranges]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean else math.nan
