"""``@smp.step`` at pipeline degree > 1: the user's function is the per-microbatch computation,
and ``torch.distributed.pipelining``'s schedule decides when each stage runs it.

Each stage runs the step function once per microbatch, when the schedule runs that microbatch's
forward there: on a stage other than the last, the function runs until the model call, whose
forward ends after the stage's last block (``StageExit``): that output is sent on. On the last
stage the function runs to its end: the model's output comes back, the user computes the loss
(in the model with ``labels=`` or from the outputs) and calls ``model.backward(loss)``, which
records the scaled loss; the schedule back-propagates it later. So code before the model call
runs once per microbatch on every stage, code after it once on the last stage.

The activation's shape must be known before the schedule starts (its receive buffers are
allocated up front), so the first stage runs microbatch 0's forward first, and tells the other
stages the shape; the schedule then uses that output for microbatch 0.

A failure (an exception from the user's function or a stage's forward) never leaves a peer
waiting: the stage records it and continues the schedule with zeros of the expected shapes, so
every send finds its receive; at the end of the step every rank learns of it and raises
(``outputs.agree``). The step's return values are sent from the last stage to every stage.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..config import virtual_round_problem
from . import ties
from .inputs import from_first_stage
from .outputs import Failure, StepFailed, agree, pack, unpack
from .split import Stage
from .stage import Boundary, StageExit, build_schedule, step_schedule

logger = logging.getLogger("modelparallel")

_CACHED_SCHEDULES = 8


@dataclass
class _StepState:
    f: Callable
    pieces: list
    ctx: Any
    results: dict = field(default_factory=dict)
    losses: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    activation: tuple | None = None
    failure: Failure | None = None
    error: BaseException | None = None


class Runner:
    """Runs ``@smp.step`` calls through one stage of a split model.

    Args:
        module: the split model (``module._mp_stage`` is its stage).
        rt: the runtime (config, meshes, groups, device).
        pp_group: the pipeline group (one rank per stage, this rank's data and tensor coordinates).
        finish: called after the schedule of a training step; averages gradients over
            data-parallel replicas and returns whether the step's gradients are now final (the
            end of a ``backward_passes_per_step`` window).
    """

    def __init__(self, module, rt, pp_group: dist.ProcessGroup, finish: Callable[[], bool]):
        self.module, self.rt, self.group, self.finish = module, rt, pp_group, finish
        self.stage: Stage = module._mp_stage
        self.boundary = Boundary(self.stage)
        self.tied = ties.tied_parameters(module, self.stage)
        self.tie_groups = ties.pair_groups(self.stage, rt.world_mesh, rt.mesh_cache)
        self.schedules: OrderedDict = OrderedDict()
        self._step: _StepState | None = None

    def sync_ties(self) -> None:
        """Copy the first stage's value of every weight tied across stages to its other copy (a
        collective of the job): stages that initialized their parameters independently (delayed
        initialization) drew different numbers for the two copies."""
        ties.sync_tied_weights(self.tied, self.tie_groups)

    # ---- one step ----------------------------------------------------------------------------

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The step function's arguments with the first stage's tensors in place of this
        stage's (SageMaker feeds a pipeline from its first stage; see ``inputs.py``)."""
        return from_first_stage(args, kwargs, self.group, self.stage.is_first, self.rt.device)

    def run(self, f: Callable, pieces: list, ctx) -> list:
        """Run ``f`` on every microbatch (``pieces``: per-microbatch ``(args, kwargs)``) through
        the pipeline; return its per-microbatch results, on every stage. A collective of the
        whole job (each pipeline group runs its schedule, then every rank agrees on failures)."""
        problem = virtual_round_problem(self.rt.config, len(pieces))
        if problem:  # before any collective; every rank raises it
            raise ValueError(problem)
        st = self._step = _StepState(f, pieces, ctx)
        train = torch.is_grad_enabled()
        try:
            st.activation = self._share_activation()
            if st.activation is not None:
                self._schedule_all(st, train)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            self._fail(e)
        finally:
            self._step = None
        payload = pack([st.results.get(i) for i in range(len(pieces))]) \
            if self.stage.is_last and st.failure is None else None
        try:
            outcomes = agree(st.failure, payload, self.group, dist.group.WORLD if train else None, self.rt.device)
        except StepFailed as e:
            raise e from st.error  # on the failing rank, the original exception and its traceback
        results = [st.results.get(i) for i in range(len(pieces))] if self.stage.is_last \
            else unpack(outcomes[-1], self.rt.tp_mesh, self.rt.device)
        if train and self.finish():
            ties.sum_tied_grads(self.tied, self.tie_groups)
        return results

    def _share_activation(self) -> tuple | None:
        """The first stage runs microbatch 0 and sends the activation's (shape, dtype) to every
        stage (None: it failed, and nobody runs the schedule)."""
        box = [None]
        if self.stage.is_first:
            try:
                out = self._step.cache[(0, 0)] = self._call(0, 0, None)
                box[0] = (tuple(out.shape), out.dtype)
            except Exception as e:  # noqa: BLE001 - every stage must hear that there is no schedule
                self._fail(e)
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def _schedule_all(self, st: _StepState, train: bool) -> None:
        n = len(st.pieces)
        size = self.rt.config.active_microbatches or n
        for start in range(0, n, size):
            count = min(size, n - start)
            step_schedule(self._schedule(st.activation, count), self.stage, start, count, train)

    def _schedule(self, activation, count: int):
        kind = self.rt.config.pipeline
        key = (activation, count, kind)
        if key not in self.schedules:
            if len(self.schedules) >= _CACHED_SCHEDULES:
                self.schedules.popitem(last=False)
            self.schedules[key] = build_schedule(self.stage, self._forward, activation, count, kind, self.group,
                                                 self.rt.device, self._fail)
        self.schedules.move_to_end(key)
        return self.schedules[key]

    # ---- one microbatch ----------------------------------------------------------------------

    def _forward(self, s: int, i: int, activation: torch.Tensor | None) -> torch.Tensor:
        """Microbatch ``i``'s output on stage ``s`` (its activation, or on the last stage its
        loss); after a failure, zeros of the expected shape."""
        st = self._step
        if (s, i) in st.cache:
            return st.cache.pop((s, i))
        if st.failure is None:
            try:
                return self._call(s, i, activation)
            except Exception as e:  # noqa: BLE001 - recorded, raised on every rank at the step's end
                self._fail(e)
        if s == len(self.stage.ranges) - 1:
            return torch.zeros((), device=self.rt.device, requires_grad=True)
        shape, dtype = st.activation
        return torch.zeros(shape, dtype=dtype, device=self.rt.device, requires_grad=True)

    def _call(self, s: int, i: int, activation: torch.Tensor | None) -> torch.Tensor:
        st = self._step
        args, kwargs = st.pieces[i]
        st.ctx.microbatch = i
        try:
            with self.boundary.running(s, activation):
                value = st.f(*args, **kwargs)
        except StageExit as done:
            return self._checked(done.hidden, i)
        if s != len(self.stage.ranges) - 1:
            raise RuntimeError(f"the @smp.step function returned without calling the model (microbatch {i}); at "
                               "pipeline_parallel_degree > 1 it must call the DistributedModel once per microbatch")
        st.results[i] = value
        loss = st.losses.pop(i, None)
        if loss is None:  # forward only: nothing to back-propagate but the schedule's zeros
            return torch.zeros((), device=self.rt.device, requires_grad=torch.is_grad_enabled())
        return loss

    def _checked(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        if isinstance(hidden, DTensor):
            if not all(isinstance(p, Replicate) for p in hidden.placements):
                raise RuntimeError(f"pipeline rank {self.stage.index}'s output is sharded ({hidden.placements}); a "
                                   "stage sends a whole activation")
            hidden = hidden.to_local()
        want = self._step.activation
        if want is not None and (tuple(hidden.shape), hidden.dtype) != want:
            raise ValueError(f"microbatch {i}'s activation has shape {tuple(hidden.shape)} ({hidden.dtype}) but "
                             f"microbatch 0's has {want[0]} ({want[1]}): every microbatch of a step must have the "
                             "same shape (pad to a fixed length)")
        return hidden

    def _fail(self, error: BaseException) -> None:
        st = self._step
        if st is not None and st.failure is None:
            st.failure, st.error = Failure.of(error, self.stage.index), error

    # ---- called by DistributedModel.backward ---------------------------------------------------

    def record_backward(self, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """Keep ``backward(tensors, grads)`` of the running microbatch (already scaled) as one
        scalar whose gradient is the same (``sum(t * g)``), for the schedule to back-propagate."""
        st = self._step
        if st is None:
            raise RuntimeError("at pipeline_parallel_degree > 1, model.backward runs inside an @smp.step function")
        terms = []
        for t, g in zip(tensors, grads):
            if g is None and t.numel() != 1:
                raise RuntimeError(f"model.backward: grad can be implicitly created only for scalar outputs "
                                   f"(got shape {tuple(t.shape)}); pass grad_tensors")
            terms.append(t.reshape(()) if g is None else (t * g).sum())
        loss = sum(terms[1:], terms[0])
        i = st.ctx.microbatch
        st.losses[i] = loss if i not in st.losses else st.losses[i] + loss
