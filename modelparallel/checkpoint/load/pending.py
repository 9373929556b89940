"""A resume waiting for the model (and optimizer) it loads into, all or nothing.

``resume_from_checkpoint`` checks the checkpoint's structure and reads the user content at once;
the tensors are loaded when the ``DistributedModel`` / ``DistributedOptimizer`` exist (at once if
they already do). Every part is read into staging and checked before the first live tensor
changes (``staging``): with both present, model and optimizer parts are both read and checked
first; with only the model, the optimizer part's parameter names and shapes are checked against
it, and the model's previous values are kept until the optimizer part arrives, so a refused
optimizer part puts the model back. Any failure disarms the pending load, so a later, unrelated
model never replays it.

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
    """Each callable is a collective run on every rank; the ``prepare_*`` ones read and check
    (raising on every rank if anything does not fit) and change nothing live.

    Attributes:
        prepare_model: model -> ``staging.ModelLoad`` (read into staging, checked).
        prepare_optimizer: (model, optimizer) -> ``partial_load.OptimizerLoad``, or None when
            the optimizer is not loaded.
        check_optimizer_names: model -> None, before the optimizer exists (raises on misfit).
        model: the model loaded so far (None until then).
        model_load: while the optimizer part still waits, the model's load with its previous
            values kept (``ModelLoad.restore`` puts them back if the optimizer part is refused).
        armed: True while a load is still to come; False once done, failed or replaced.
        reports: per part ("model", "optimizer"), what the load skipped.
        costs: per part, what protecting the live values cost (staged bytes, or the journal's).
    """

    prepare_model: Callable[[Any], Any]
    prepare_optimizer: Callable[[Any, Any], Any] | None = None
    check_optimizer_names: Callable[[Any], None] | None = None
    model: Any = None
    model_load: Any = None
    armed: bool = True
    reports: dict[str, LoadReport] = field(default_factory=dict)
    costs: dict[str, Any] = field(default_factory=dict)

    def on_model(self, model, optimizer=None) -> None:
        """Called when a ``DistributedModel`` exists (with the optimizer too, if it exists):
        everything is read and checked, then applied."""
        with _disarm_on_error(self):
            if optimizer is None and self.check_optimizer_names is not None:
                self.check_optimizer_names(model)
            load = self.prepare_model(model)
            try:  # a model read through a journal is live already: put it back if the optimizer fails
                opt = self.prepare_optimizer(model, optimizer) if optimizer is not None and self.prepare_optimizer \
                    else None
            except BaseException as e:
                load.restore(e)
                raise
            waiting = optimizer is None and self.prepare_optimizer is not None
            load.apply(keep_old=waiting)
            self.model_load = load if waiting else None
            self.reports.clear()
            self.costs.clear()
            self.reports["model"] = _logged("model", load.report)
            self.costs["model"] = _cost("model", load.cost)
            self.model = model
            if opt is not None:
                opt.apply()
                self.reports["optimizer"] = _logged("optimizer", opt.report)
                self.costs["optimizer"] = _cost("optimizer", opt.cost)
            if not waiting:
                self.armed = False

    def on_optimizer(self, optimizer) -> None:
        """Called when a ``DistributedOptimizer`` exists (after the model). If its part is
        refused, the model is put back as it was before the resume."""
        if self.model is None or self.prepare_optimizer is None or not self.armed:
            return
        try:
            opt = self.prepare_optimizer(self.model, optimizer)
        except BaseException as e:
            load, self.model_load, self.armed = self.model_load, None, False
            self.reports.clear()
            if load is not None:
                load.restore(e)
            raise
        opt.apply()
        self.reports["optimizer"] = _logged("optimizer", opt.report)
        self.costs["optimizer"] = _cost("optimizer", opt.cost)
        if self.model_load is not None:
            self.model_load.release()
        self.model_load, self.armed = None, False


class _disarm_on_error:
    def __init__(self, pending: PendingResume):
        self.pending = pending

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:
            self.pending.armed = False
        return False


def _cost(part: str, cost):
    """Log (each rank: each decides for its own memory) how the live values were protected."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    logger.info("resume_from_checkpoint, %s part, rank %d: %s", part, rank, cost)
    return cost


def _logged(part: str, report: LoadReport) -> LoadReport:
    """A non-strict load's skipped entries, logged once (rank 0) so they are not missed."""
    problems = report.problems(part)
    if problems and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("resume_from_checkpoint(strict=False) skipped:\n  - %s", "\n  - ".join(problems))
    return report
