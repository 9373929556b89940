"""What a pipelined step returns, on every rank, and how its failures reach every rank.

The step function completes only on the last stage (earlier stages stop at their last block),
so its return values exist there. At the end of a step the pipeline group all-gathers each
stage's outcome: the last stage's return values (tensors detached, on the CPU; a DTensor as its
local shard and placements, rebuilt on the receiver's own tensor-parallel mesh, whose rank holds
the same shard) and each stage's error, if any. Then one all-reduce over the world tells every
rank whether any rank failed, so data-parallel replicas whose own pipeline ran cleanly stop too
instead of waiting in the gradient average.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class _Sharded:
    local: torch.Tensor
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _map(obj: Any, fn) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``, inside lists, tuples (named ones
    too) and dicts (Hugging Face's ``ModelOutput`` too)."""
    if isinstance(obj, (torch.Tensor, _Sharded)):
        return fn(obj)
    if isinstance(obj, dict):
        items = {k: _map(v, fn) for k, v in obj.items()}
        return type(obj)(**items) if hasattr(obj, "__dataclass_fields__") else type(obj)(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def pack(results: list) -> list:
    """The last stage's per-microbatch return values, ready to send."""
    def one(t: torch.Tensor):
        if isinstance(t, DTensor):
            return _Sharded(t.to_local().detach().cpu(), tuple(t.placements), tuple(t.shape), tuple(t.stride()))
        return t.detach().cpu()
    return _map(results, one)


def unpack(payload: list, tp_mesh, device: torch.device) -> list:
    """Return values received from the last stage, on this rank's device (a DTensor rebuilt on
    ``tp_mesh``)."""
    def one(t):
        if isinstance(t, _Sharded):
            return DTensor.from_local(t.local.to(device), tp_mesh, t.placements, shape=torch.Size(t.shape),
                                      stride=t.stride, run_check=False)
        return t.to(device)
    return _map(payload, one)


class StepFailed(RuntimeError):
    """Raised on every rank when a rank failed during a pipelined ``@smp.step`` call."""


_STAGE_BACKWARD = "Failed to run stage backward"  # torch.distributed.pipelining's wrapper of a backward's error


@dataclass
class Failure:
    """One rank's error during a step: where, and the text of its traceback."""

    rank: int
    stage: int
    kind: str
    message: str
    trace: str

    @classmethod
    def of(cls, error: BaseException, stage: int) -> Failure:
        """``error``'s record; a stage's backward that PyTorch's schedule re-raised (its message
        lists the stage's tensors) is named by the error that ended it."""
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        named = error
        if error.__cause__ is not None and _STAGE_BACKWARD in str(error):
            named = error.__cause__
        return cls(dist.get_rank(), stage, type(named).__name__, str(named), trace)

    def describe(self) -> str:
        return (f"@smp.step failed on rank {self.rank} (pipeline stage {self.stage}): {self.kind}: {self.message}\n"
                f"--- traceback on rank {self.rank} ---\n{self.trace}")


def agree(failure: Failure | None, payload, pp_group, world_group, device: torch.device) -> list:
    """Exchange outcomes (a collective of the pipeline group, then of ``world_group``: the world
    for a training step, whose gradient average waits for every replica; None for a forward-only
    step, which data-parallel replicas may run different numbers of); return what every stage
    sent, or raise ``StepFailed`` on every rank that took part if any of them failed."""
    outcomes: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(outcomes, (failure, payload), group=pp_group)
    if world_group is None:
        first = next((f for f, _ in outcomes if f is not None), None)
        if first is not None:
            raise StepFailed(first.describe())
        return [p for _, p in outcomes]
    flag = torch.tensor([float(any(f is not None for f, _ in outcomes))],
                        device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world_group)
    if flag.item() == 0:
        return [p for _, p in outcomes]
    mine = next((f for f, _ in outcomes if f is not None), None)
    everyone: list = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(everyone, mine, group=world_group)
    first = min((f for f in everyone if f is not None), key=lambda f: (f.stage == -1, f.rank))
    raise StepFailed(first.describe())
