"""Manual pipeline partitions: SageMaker's ``with smp.partition(i):`` and ``smp.set_partition``.

A partition index lives on the module itself (``_mp_partition``), like tensor-parallel marks:
modules registered on a parent inside an open ``partition`` block get the innermost block's
index, ``set_partition`` sets it on one module. A module's partition is its own mark or that of
its nearest marked ancestor; unmarked modules take ``default_partition``. The marks are read
when the model is split, and only with ``auto_partition`` false (SageMaker ignores them
otherwise). Nothing here depends on the pipeline degree, so SageMaker scripts that call
``set_partition`` at degree 1 run unchanged.
"""

from __future__ import annotations

import contextlib

from torch import nn

from ..activations.wrappers import INNER
from ..tp.creation_marks import CreationMarks

MARK = "_mp_partition"  # the attribute a module's partition index is kept in
_MARKS = CreationMarks(MARK)


def _check_index(index, where: str) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{where}: a partition index is an integer >= 0, got {index!r}")
    return index


@contextlib.contextmanager
def partition(index: int):
    """Place the modules created inside this block on pipeline partition ``index`` (the
    innermost block wins). Honoured when ``auto_partition`` is false; the index must be below
    ``pipeline_parallel_degree`` then (checked when the model is split, naming the module).

    Raises:
        ValueError: if ``index`` is not an integer >= 0.
    """
    with _MARKS.marking(_check_index(index, "smp.partition")):
        yield


def set_partition(module: nn.Module, index: int) -> None:
    """Place ``module`` (and its unmarked submodules) on pipeline partition ``index``, before
    the model is split: before ``smp.DistributedModel`` with ``auto_partition`` true (where the
    marks are ignored anyway) and, with ``auto_partition`` false, before the first ``@smp.step``
    call or anything else that needs the stages (``DistributedOptimizer``, loading a checkpoint).

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
        ValueError: if ``index`` is not an integer >= 0, or the model was split already and put
            ``module`` on another stage.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_partition: expected an nn.Module, got {type(module).__name__}")
    index = _check_index(index, "smp.set_partition")
    placed = _placed(module)
    if placed is not None and placed != index:
        raise ValueError(f"smp.set_partition({type(module).__name__}, {index}): the model was already split "
                         f"and this module runs on partition {placed}; call set_partition before the first "
                         "@smp.step call (or before DistributedModel with auto_partition true)")
    setattr(module, MARK, index)


def _placed(module: nn.Module) -> int | None:
    """The stage the split put ``module`` on, looking through activation wrappers (PyTorch's
    checkpoint and offload wrappers hold the block under ``wrappers.INNER``)."""
    while module is not None:
        placed = module.__dict__.get("_mp_stage_of")
        if placed is not None:
            return placed
        module = module._modules.get(INNER)
    return None


def partition_of(model: nn.Module, path: str, default: int) -> tuple[int, bool]:
    """The partition of the submodule at ``path``: (index, whether a mark set it) from its own
    mark or its nearest marked ancestor's, else (``default``, False)."""
    segs = path.split(".") if path else []
    for i in range(len(segs), -1, -1):
        index = model.get_submodule(".".join(segs[:i])).__dict__.get(MARK)
        if index is not None:
            return index, True
    return default, False
