"""One stage's edges and its ``torch.distributed.pipelining`` objects.

``Boundary`` hooks the stage's first and last local blocks: the activation received from the
previous stage replaces the first block's hidden-states input, and the last block's output ends
the forward by raising ``StageExit`` (a ``BaseException``, so a user's ``except Exception``
does not swallow it), which also ends the user's step function on that stage for the
microbatch. The hooks act only while the runner is running a microbatch (``active``); a forward
outside ``@smp.step`` is refused. With virtual stages a rank holds the blocks of several stages
in one ``ModuleList``; while one of them runs, the list holds only that stage's blocks (the
model's forward loops over the list), so the others neither run nor see its activation.

The hooks sit on the block list's entries, not on the blocks: on whatever the entry is when a
microbatch runs (the block, or what the script wrapped it in: PyTorch's ``CheckpointWrapper``,
applied after ``DistributedModel`` or put back by it), moved there at the start of each
microbatch. An activation checkpoint recomputes what is inside the entry during backward; hooks
inside it would run again there (no activation pending, or a stage exit in the middle of
backward). Outside it, the checkpoint saves, and recomputes from, the received activation, and
the stage exits after the checkpointed call has returned. Checkpointing that replaces a block's
``forward`` (``smp.set_activation_checkpointing``, Hugging Face's
``gradient_checkpointing_enable``) leaves the entry's hooks outside already. Hooks that
recomputation could re-run safely (the same activation handed out twice, no exit while
recomputing) would have to tell a recompute from a second call of the model in one microbatch,
which they refuse; outside the region there is nothing to tell apart. A region around several
blocks (the whole decoder) still holds the edges, and is refused when it recomputes. The
entry's pre-hook runs before its other pre-hooks (sequence parallelism's cut, FSDP's input
cast), which then see the received activation; the exit hook after its other hooks.

``build_schedule`` makes a ``PipelineStage`` (one that survives a failing backward) with static
tensor metadata (the activation is one
``[batch, sequence, hidden]`` tensor between every pair of stages; the last stage's output is
the microbatch's scalar loss) and wraps it in ``ScheduleGPipe`` ("simple") or ``Schedule1F1B``
("interleaved"), with an identity loss function: the loss is what the user's function passed to
``model.backward``, already scaled. With virtual stages (``pipeline_virtual_stages`` > 1) it
makes one ``PipelineStage`` per stage of the rank and runs them with ``ScheduleLoopedBFS``
("simple": each stage runs all its forwards, then all its backwards) or
``ScheduleInterleaved1F1B`` ("interleaved").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleLoopedBFS)

from .split import Stage

logger = logging.getLogger("modelparallel")

SCHEDULES = {"simple": ScheduleGPipe, "interleaved": Schedule1F1B}
VIRTUAL_SCHEDULES = {"simple": ScheduleLoopedBFS, "interleaved": ScheduleInterleaved1F1B}


class StageExit(BaseException):
    """Carries a non-last stage's output (its last block's hidden states) out of the forward."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage output")
        self.hidden = hidden


NOT_IN_STEP = ("at pipeline_parallel_degree > 1 the model runs inside an @smp.step function (the step's "
               "microbatches flow through the stages); calling it directly (or model.generate) is not supported")
RECOMPUTED = (" (or, during backward, an activation checkpoint around several blocks is recomputing a stage's first "
              "or last block: checkpoint each block instead)")


class Boundary:
    """The hooks at the two ends of each of the rank's stages (see the module docstring)."""

    def __init__(self, stage: Stage, hidden_arg: str = "hidden_states"):
        self.stage, self.hidden_arg = stage, hidden_arg
        self.active = False
        self.pending: torch.Tensor | None = None
        self.hooked: dict[tuple[int, str], tuple[nn.Module, RemovableHandle]] = {}
        self.follow()

    def follow(self) -> None:
        """Put each hook on the list entry now at its block's index, wherever that moved (a
        wrapper applied since the last microbatch); the entry it was on loses it."""
        last = len(self.stage.ranges) - 1
        modules = self.stage.block_list._modules
        for s in self.stage.stages:
            lo, hi = self.stage.ranges[s]
            if s != 0:
                self._hook((lo, "enter"), modules[str(lo)])
            if s != last:
                self._hook((hi - 1, "exit"), modules[str(hi - 1)])

    def _hook(self, key: tuple[int, str], entry: nn.Module) -> None:
        held = self.hooked.get(key)
        if held is not None and held[0] is entry:
            return
        if held is not None:
            held[1].remove()
        if key[1] == "enter":  # first, so other pre-hooks (FSDP's input cast) see the activation
            handle = entry.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True)
        else:  # last, after the others (FSDP's post-forward) have run
            handle = entry.register_forward_hook(self._exit)
        self.hooked[key] = (entry, handle)

    @contextmanager
    def running(self, s: int, activation: torch.Tensor | None) -> Iterator[None]:
        """Stage ``s`` runs one microbatch (``activation``: its input from the previous stage)."""
        swap = self.stage.virtual > 1
        self.follow()
        modules = self.stage.block_list._modules
        held = dict(modules)
        if swap:  # the list's own entries for stage s's blocks (whatever wraps them now)
            modules.clear()
            modules.update((str(i), held[str(i)]) for i in range(*self.stage.ranges[s]))
        self.pending, self.active = activation, True
        try:
            yield
        finally:
            self.active, self.pending = False, None
            if swap:
                modules.clear()
                modules.update(held)

    def _enter(self, module, args, kwargs):
        if not self.active:
            raise RuntimeError(NOT_IN_STEP + RECOMPUTED)
        if self.pending is None:
            raise RuntimeError("at pipeline_parallel_degree > 1 the step function calls the model once per "
                               "microbatch; it was called again")
        x, self.pending = self.pending, None
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, self.hidden_arg: x}

    def _exit(self, module, args, output):
        if not self.active:
            raise RuntimeError(NOT_IN_STEP + RECOMPUTED)
        raise StageExit(output[0] if isinstance(output, (tuple, list)) else output)


class _Microbatch(nn.Module):
    """The module ``PipelineStage`` runs: microbatch ``mb`` of the step through ``run``.

    It holds no parameters (the model's gradients are accumulated by autograd through the
    user's forward); the first stage gets ``mb`` as its root argument too, later stages the
    received activation."""

    def __init__(self, run: Callable[[int, torch.Tensor | None], torch.Tensor], first: bool):
        super().__init__()
        self.run, self.first = run, first

    def forward(self, *args, mb: torch.Tensor):
        return self.run(int(mb), None if self.first else args[0])


class _KeepGoing(PipelineStage):
    """A ``PipelineStage`` whose backward records a failure instead of leaving the schedule:
    the previous stage then receives zero gradients and every rank reaches the step's end,
    where the failure is raised everywhere (a raise here would leave the peers waiting).

    The zeros are made here: after a failure (or for a microbatch whose loss a failed forward
    replaced by a constant) the activation's gradient is None, and only some PyTorch releases
    send zeros for a None gradient (torch 2.11 raises instead, after the previous stage has
    posted its receive)."""

    def __init__(self, *args, on_error: Callable[[BaseException], None], activation: tuple, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_error, self.activation = on_error, activation

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        try:
            out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                             last_backward=last_backward)
        except Exception as e:  # noqa: BLE001 - raised on every rank at the step's end
            self.on_error(e)
            self.fwd_cache.pop(bwd_chunk_id, None)
            self.bwd_cache[bwd_chunk_id] = (None,)  # one input, the activation
            out = None
        grads = self.bwd_cache.get(bwd_chunk_id)  # none in a forward-only (eval) schedule
        if not self.is_first and grads is not None:
            shape, dtype = self.activation
            self.bwd_cache[bwd_chunk_id] = tuple(torch.zeros(shape, dtype=dtype, device=self.device)
                                                 if g is None else g for g in grads)
        return out


def _meta(shape, dtype, requires_grad: bool = True) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


def build_schedule(stage: Stage, run, activation: tuple[tuple[int, ...], torch.dtype], microbatches: int,
                   kind: str, group: dist.ProcessGroup, device: torch.device,
                   on_error: Callable[[BaseException], None]):
    """A schedule for ``microbatches`` microbatches whose activations have ``activation``'s
    (shape, dtype); ``run(s, i, activation)`` runs microbatch ``i`` on stage ``s``. ``kind``
    "interleaved" with fewer microbatches than stages (and no virtual stages) runs GPipe (1F1B
    needs one microbatch per stage to fill the pipeline; with fewer it is GPipe anyway)."""
    act = _meta(*activation)
    first = torch.empty(1, dtype=torch.long, device="meta")
    loss = _meta((), torch.float32)
    n = len(stage.ranges)
    pipe_stages = [_KeepGoing(_Microbatch(partial(run, s), s == 0), s, n, device,
                              input_args=(first,) if s == 0 else (act,),
                              output_args=(loss,) if s == n - 1 else (act,), group=group, on_error=on_error,
                              activation=activation) for s in stage.stages]
    if stage.virtual > 1:
        return VIRTUAL_SCHEDULES[kind](pipe_stages, microbatches, loss_fn=_identity, scale_grads=False)
    cls = SCHEDULES[kind]
    if cls is Schedule1F1B and microbatches < stage.count:
        cls = ScheduleGPipe
    return cls(pipe_stages[0], microbatches, loss_fn=_identity, scale_grads=False)


def _identity(output, target):
    return output


def step_schedule(schedule, stage: Stage, first_mb: int, microbatches: int, train: bool) -> None:
    """Run ``schedule`` on microbatches ``first_mb`` .. ``first_mb + microbatches - 1``."""
    mbs = torch.arange(first_mb, first_mb + microbatches)
    root = (mbs,) if stage.is_first else ()
    kwargs = dict(mb=mbs, return_outputs=False)
    if stage.is_last:
        kwargs["target"] = mbs
    (schedule.step if train else schedule.eval)(*root, **kwargs)
