"""Pipeline parallelism, SageMaker v1's way, on ``torch.distributed.pipelining``.

``split_model`` (step 1 of ``parallelize``) cuts a model into this rank's stage from its
architecture's ``PipelineSplit`` (``split``), with the blocks assigned by cost or by the user's
``smp.partition`` marks (``placement``, ``marks``); ``Runner`` runs ``@smp.step``'s microbatches
through the stage with PyTorch's GPipe or 1F1B schedule (``runner``, ``stage``), sends the step's
outputs to every stage and every failure to every rank (``outputs``), and sums the gradients of
weights tied across stages (``ties``). Nothing here imports the API layer.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch.distributed as dist
from torch import nn

from ..tp.layout import base_prefix
from ..tp.plan import ArchSpec, ModulePlan, join
from .marks import partition, partition_of, set_partition
from .placement import balanced, check_count, ignored_marks, manual, param_count
from .runner import Runner
from .split import Elsewhere, PipelineSplit, Stage, apply, blocks_of, describe, regions
from .outputs import StepFailed

logger = logging.getLogger("modelparallel")

__all__ = ["PipelineSplit", "Runner", "Stage", "StepFailed", "check_model", "partition", "partition_of", "plan_ranges",
           "set_partition", "split_model", "stage_spec"]


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _hidden_size(model: nn.Module, split: PipelineSplit) -> int:
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if size is None:
        first = model.get_submodule(join(base_prefix(model), split.first[0]))
        size = first.embedding_dim
    return size


def _fixed_costs(model: nn.Module, split: PipelineSplit) -> tuple[int, int]:
    first, last = regions(model, split)
    return (sum(param_count(model.get_submodule(p)) for p in first),
            sum(param_count(model.get_submodule(p)) for p in last))


def plan_ranges(model: nn.Module, split: PipelineSplit, count: int, auto: bool, default: int, virtual: int = 1):
    """The block range of every stage (see ``partition``): ``count x virtual`` stages (manual
    marks name ``count`` partitions, so ``virtual`` is 1 there)."""
    path, blocks = blocks_of(model, split)
    check_count(len(blocks), count, f"{type(model).__name__} ({path})", virtual)
    if not auto:
        return manual(model, path, len(blocks), count, default)
    marked = ignored_marks(model)
    if marked and _rank0():
        logger.info("auto_partition is true: partition marks ignored on %s", ", ".join(marked[:8]))
    return balanced([param_count(b) for b in blocks], count * virtual, *_fixed_costs(model, split))


def check_model(model: nn.Module) -> None:
    """Refuse, before any collective, what no stage can compute from its own layers: a
    mixture-of-experts model's auxiliary load-balancing loss (``config.output_router_logits``)
    is one function of every layer's router logits, and those live on every stage; the last
    stage would compute it from its own layers only.

    Raises:
        NotImplementedError: naming the model and the config key.
    """
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise NotImplementedError(f"pipeline parallelism of {type(model).__name__} with config.output_router_logits "
                                  "True (the auxiliary load-balancing loss spans every stage's router logits); "
                                  "set output_router_logits=False")


def split_model(model: nn.Module, config, index: int, split: PipelineSplit | None) -> Stage | None:
    """Cut ``model`` down to pipeline rank ``index``'s stages in place (nothing at degree 1):
    one, or ``pipeline_virtual_stages`` of them (stages ``index``, ``index + P``, ...).

    Raises:
        NotImplementedError: for a model whose architecture has no ``PipelineSplit``.
        ValueError: for more stages than blocks, or manual partitions that do not fit.
    """
    count = config.pipeline_parallel_degree
    if count == 1:
        return None
    if split is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise NotImplementedError(f"pipeline parallelism of {type(model).__name__} (model_type {model_type!r}): "
                                  "its architecture record has no PipelineSplit (Architecture.pipeline, "
                                  "modelparallel/models/) and transformers gives it no base_model_pp_plan")
    virtual = config.pipeline_virtual_stages
    ranges = plan_ranges(model, split, count, config.auto_partition, config.default_partition, virtual)
    stage = describe(model, split, ranges, index, count)
    if not config.auto_partition:
        _, blocks = blocks_of(model, split)
        for s, (lo, hi) in enumerate(ranges):
            for b in range(lo, hi):
                blocks[b]._mp_stage_of = s
    apply(model, split, stage, _hidden_size(model, split))
    if _rank0():
        logger.info("pipeline: %d stages on %d ranks, layers %s", len(ranges), count,
                    " ".join(f"[{lo}, {hi})" for lo, hi in ranges))
    return stage


def stage_spec(spec: ArchSpec, model: nn.Module) -> ArchSpec:
    """``spec`` without the tensor-parallel rules of modules that live on other stages."""
    stubs = [p for p, m in model.named_modules() if isinstance(m, Elsewhere)]

    def keep(plan: ModulePlan, prefix: str) -> ModulePlan:
        here = {r: s for r, s in plan.rules.items()
                if not any(join(prefix, r) == p or join(prefix, r).startswith(p + ".") for p in stubs)}
        return replace(plan, rules=here)

    return replace(spec, base=keep(spec.base, base_prefix(model)), head=keep(spec.head, ""))
