"""Loss scaling for half-precision training: a static scale, or a dynamic one that adapts.

Why scale at all: float16 gradients smaller than ~6e-8 flush to zero. Multiplying the loss by a
scale S before the backward pass shifts every gradient up by S (the chain rule is linear in the
upstream gradient); dividing the gradients by S before the optimizer step restores them.

Why dynamic: the largest safe S is not known in advance. The dynamic scaler (Micikevicius et al.
2018, "Mixed Precision Training") starts high, lowers the scale when a step produces inf/nan
gradients (that step is skipped), and raises it again after ``scale_window`` good steps in a row.
The hysteresis rules (``delayed_shift``, ``consecutive_hysteresis``) are those of SageMaker model
parallelism and DeepSpeed, from which its ``dynamic_loss_args`` names come.

Every rank must take the same decision, or ranks would step different numbers of times and their
shards would drift apart: ``has_overflow`` checks this rank's gradients, then takes the maximum of
the verdicts over the process group (one all-reduce of a single number).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from ..tp.layout import local_part

DYNAMIC_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "init_scale": 2.0 ** 32,
    "scale_factor": 2.0,
    "scale_window": 1000,
    "min_scale": 1.0,
    "delayed_shift": 1,
    "consecutive_hysteresis": False,
})
"""SageMaker's ``dynamic_loss_args`` keys and their defaults (read-only)."""


def _flag_device(grads: list[torch.Tensor], group: dist.ProcessGroup) -> torch.device:
    """Where the overflow flag must live for the group's backend (NCCL only reduces CUDA tensors)."""
    if grads:
        return grads[0].device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class LossScaler:
    """A fixed loss scale. ``update_scale`` never changes it and steps are never skipped.

    Args:
        scale: the factor the loss is multiplied by before backward (1.0: no scaling).
    """

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if not (_number(scale) and scale > 0):
            raise ValueError(f"loss scale must be a number > 0, got {scale!r}")
        self.loss_scale = float(scale)

    def has_overflow(self, grads: Iterable[torch.Tensor | None],
                     group: dist.ProcessGroup | None = None) -> bool:
        """True if any rank of ``group`` (default: the world) holds an inf or nan gradient.

        A collective: every rank of the group must call it. ``None`` entries are ignored.
        """
        local = [local_part(g) for g in grads if g is not None]
        bad = torch.stack([(~torch.isfinite(g)).any() for g in local]).any() if local else False
        if not dist.is_initialized():
            return bool(bad)
        group = group if group is not None else dist.group.WORLD
        flag = torch.tensor([float(bad)], device=_flag_device(local, group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def update_scale(self, overflow: bool) -> None:
        """Record the outcome of a step; a static scale ignores it."""

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loss_scale = float(state["loss_scale"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(loss_scale={self.loss_scale})"


class DynamicLossScaler(LossScaler):
    """A loss scale that halves (``scale_factor``) on overflow and grows after good steps.

    Rules, applied by ``update_scale`` after each step:

    * overflow: the step was skipped and the run of good steps restarts. If the hysteresis
      counter (starting at ``delayed_shift``) is above 1 it is decremented and the scale kept;
      otherwise the scale is divided by ``scale_factor``, never going below ``min_scale``. So with
      ``delayed_shift=2`` the first overflow keeps the scale and the second lowers it.
    * good step: after ``scale_window`` good steps in a row the scale is multiplied by
      ``scale_factor`` and the run restarts. The hysteresis counter goes back to
      ``delayed_shift`` after every good step if ``consecutive_hysteresis`` (so only overflows in
      a row count), otherwise only when the scale grows.
    """

    dynamic = True

    def __init__(self, init_scale: float = DYNAMIC_DEFAULTS["init_scale"],
                 scale_factor: float = DYNAMIC_DEFAULTS["scale_factor"],
                 scale_window: int = DYNAMIC_DEFAULTS["scale_window"],
                 min_scale: float = DYNAMIC_DEFAULTS["min_scale"],
                 delayed_shift: int = DYNAMIC_DEFAULTS["delayed_shift"],
                 consecutive_hysteresis: bool = DYNAMIC_DEFAULTS["consecutive_hysteresis"]):
        _check_dynamic(init_scale, scale_factor, scale_window, min_scale, delayed_shift)
        super().__init__(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.good_steps = 0
        self.hysteresis = self.delayed_shift

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> DynamicLossScaler:
        """Build from SageMaker's ``dynamic_loss_args`` dict; unknown keys raise ``ValueError``
        (a misspelt key would otherwise be silently replaced by its default)."""
        args = dict(args or {})
        unknown = sorted(set(args) - set(DYNAMIC_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown dynamic_loss_args key(s) {unknown}; "
                             f"valid keys are {sorted(DYNAMIC_DEFAULTS)}")
        return cls(**args)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
        else:
            self._on_good_step()

    def _on_overflow(self) -> None:
        self.good_steps = 0
        if self.hysteresis > 1:
            self.hysteresis -= 1
        else:
            self.loss_scale = max(self.loss_scale / self.scale_factor, self.min_scale)

    def _on_good_step(self) -> None:
        self.good_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis = self.delayed_shift
        if self.good_steps >= self.scale_window:
            self.good_steps = 0
            self.hysteresis = self.delayed_shift
            self.loss_scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        """The running state (scale and counters); the rules come from the constructor."""
        return {"loss_scale": self.loss_scale, "good_steps": self.good_steps, "hysteresis": self.hysteresis}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the running state; a static scaler's state (scale only) restarts the counters."""
        super().load_state_dict(state)
        self.good_steps = int(state.get("good_steps", 0))
        self.hysteresis = int(state.get("hysteresis", self.delayed_shift))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _check_dynamic(init_scale, scale_factor, scale_window, min_scale, delayed_shift) -> None:
    """Reject settings that would make the scale collapse or never move, listing every problem."""
    problems = [msg for ok, msg in (
        (_number(init_scale) and init_scale > 0, f"init_scale must be > 0, got {init_scale!r}"),
        (_number(scale_factor) and scale_factor > 1, f"scale_factor must be > 1, got {scale_factor!r}"),
        (_count(scale_window), f"scale_window must be an integer >= 1, got {scale_window!r}"),
        (_number(min_scale) and min_scale > 0, f"min_scale must be > 0, got {min_scale!r}"),
        (_count(delayed_shift), f"delayed_shift must be an integer >= 1, got {delayed_shift!r}"),
    ) if not ok]
    if problems:
        raise ValueError("invalid dynamic_loss_args: " + "; ".join(problems))
