"""A resume waiting for the model (and optimizer) it loads into, all or nothing.

``resume_from_checkpoint`` verifies files and reads the user content at once; the tensors are
loaded when the ``DistributedModel`` / ``DistributedOptimizer`` exist (at once if they already
do). Everything that can be checked is checked before the first tensor changes: with both
present, the optimizer part is planned (keys, shapes, groups) before the model is loaded; with
only the model, the optimizer part's parameter names and shapes are checked against it. Any
failure disarms the pending load, so a later, unrelated model never replays it.

The resume keeps its own state (``armed``: still waiting; ``reports``: what each part's load
skipped); the runtime only records which resume is the newest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from .parts import LoadReport

logger = logging.getLogger("modelparallel")


@dataclass
class PendingResume:
    """Each callable is a collective run on every rank.

    Attributes:
        check_model: model -> plan (raises if the model part does not fit; changes nothing).
        load_model: (model, plan) -> report: the read.
        check_optimizer_names: model -> None, before the optimizer exists (raises on misfit).
        plan_optimizer: (model, optimizer) -> plan (raises on misfit; changes nothing).
        load_optimizer: (model, optimizer, plan) -> report.
        model: the model loaded so far (None until then).
        armed: True while a load is still to come; False once done, failed or replaced.
        reports: per part ("model", "optimizer"), what the load skipped.
    """

    check_model: Callable[[Any], Any]
    load_model: Callable[[Any, Any], LoadReport]
    check_optimizer_names: Callable[[Any], None] | None = None
    plan_optimizer: Callable[[Any, Any], Any] | None = None
    load_optimizer: Callable[[Any, Any, Any], LoadReport] | None = None
    model: Any = None
    armed: bool = True
    reports: dict[str, LoadReport] = field(default_factory=dict)

    def on_model(self, model, optimizer=None) -> None:
        """Called when a ``DistributedModel`` exists (with the optimizer too, if it exists)."""
        with _disarm_on_error(self):
            opt_plan = None
            if optimizer is not None:
                opt_plan = self.plan_optimizer(model, optimizer)
            elif self.check_optimizer_names is not None:
                self.check_optimizer_names(model)
            plan = self.check_model(model)
            self.reports.clear()
            self.reports["model"] = _logged("model", self.load_model(model, plan))
            self.model = model
            if optimizer is not None:
                self.reports["optimizer"] = _logged("optimizer", self.load_optimizer(model, optimizer, opt_plan))
            if self.load_optimizer is None or optimizer is not None:
                self.armed = False

    def on_optimizer(self, optimizer) -> None:
        """Called when a ``DistributedOptimizer`` exists (after the model)."""
        if self.model is None or self.load_optimizer is None:
            return
        with _disarm_on_error(self):
            plan = self.plan_optimizer(self.model, optimizer)
            self.reports["optimizer"] = _logged("optimizer", self.load_optimizer(self.model, optimizer, plan))
            self.armed = False


class _disarm_on_error:
    def __init__(self, pending: PendingResume):
        self.pending = pending

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:
            self.pending.armed = False
        return False


def _logged(part: str, report: LoadReport) -> LoadReport:
    """A non-strict load's skipped entries, logged once (rank 0) so they are not missed."""
    problems = report.problems(part)
    if problems and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("resume_from_checkpoint(strict=False) skipped:\n  - %s", "\n  - ".join(problems))
    return report
