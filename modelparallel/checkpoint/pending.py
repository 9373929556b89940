"""A resume waiting for the model (and optimizer) it loads into, all or nothing.

``resume_from_checkpoint`` verifies files and reads the user content at once; the tensors are
loaded when the ``DistributedModel`` / ``DistributedOptimizer`` exist (at once if they already
do). Everything that can be checked is checked before the first tensor changes: with both
present, the optimizer part is planned (keys, shapes, groups) before the model is loaded; with
only the model, the optimizer part's parameter names and shapes are checked against it. Any
failure disarms the pending load, so a later, unrelated model never replays it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from .. import runtime
from .parts import LoadReport

logger = logging.getLogger("modelparallel")

LAST_REPORTS: dict[str, LoadReport] = {}


@dataclass
class PendingResume:
    """Each callable is a collective run on every rank.

    Attributes:
        check_model: model -> plan (raises if the model part does not fit; changes nothing).
        load_model: (model, plan) -> report: the read.
        check_optimizer_names: model -> None, before the optimizer exists (raises on misfit).
        plan_optimizer: (model, optimizer) -> plan (raises on misfit; changes nothing).
        load_optimizer: (model, optimizer, plan) -> report.
    """

    check_model: Callable[[Any], Any]
    load_model: Callable[[Any, Any], LoadReport]
    check_optimizer_names: Callable[[Any], None] | None = None
    plan_optimizer: Callable[[Any, Any], Any] | None = None
    load_optimizer: Callable[[Any, Any, Any], LoadReport] | None = None
    model: Any = None

    def on_model(self, model, optimizer=None) -> None:
        """Called when a ``DistributedModel`` exists (with the optimizer too, if it exists)."""
        with _disarm_on_error():
            opt_plan = None
            if optimizer is not None:
                opt_plan = self.plan_optimizer(model, optimizer)
            elif self.check_optimizer_names is not None:
                self.check_optimizer_names(model)
            plan = self.check_model(model)
            LAST_REPORTS.clear()
            LAST_REPORTS["model"] = _logged("model", self.load_model(model, plan))
            self.model = model
            if optimizer is not None:
                LAST_REPORTS["optimizer"] = _logged("optimizer", self.load_optimizer(model, optimizer, opt_plan))
            if self.load_optimizer is None or optimizer is not None:
                runtime.current().pending_resume = None

    def on_optimizer(self, optimizer) -> None:
        """Called when a ``DistributedOptimizer`` exists (after the model)."""
        if self.model is None or self.load_optimizer is None:
            return
        with _disarm_on_error():
            plan = self.plan_optimizer(self.model, optimizer)
            LAST_REPORTS["optimizer"] = _logged("optimizer", self.load_optimizer(self.model, optimizer, plan))
            runtime.current().pending_resume = None


class _disarm_on_error:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:
            runtime.current().pending_resume = None
        return False


def _logged(part: str, report: LoadReport) -> LoadReport:
    """A non-strict load's skipped entries, logged once (rank 0) so they are not missed."""
    problems = report.problems(part)
    if problems and runtime.rank() == 0:
        logger.warning("resume_from_checkpoint(strict=False) skipped:\n  - %s", "\n  - ".join(problems))
    return report
