"""``DistributedOptimizer``: SageMaker's optimizer wrapper, adding loss scaling to any optimizer.

The wrapped optimizer does the update; the wrapper only (1) owns the loss scale that
``DistributedModel.backward`` multiplies the loss by, (2) divides the gradients by it before the
update, and (3) with dynamic scaling, skips the update on every rank when any rank saw an inf/nan
gradient. Sharded parameters are DTensors, so an unmodified ``torch.optim`` optimizer updates
each rank's shard; nothing else is needed for tensor parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import runtime
from .checkpoint.legacy import local_optimizer_state, to_param_layout
from .dp import local_grad
from .loss_scaler import DynamicLossScaler, LossScaler

logger = logging.getLogger("modelparallel")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` (built from a ``DistributedModel``'s parameters) with loss scaling.

    It subclasses ``torch.optim.Optimizer`` so learning-rate schedulers accept it, but does not
    call its constructor: the wrapped optimizer keeps the one copy of ``param_groups`` and
    ``state``, which the wrapper exposes as its own.

    Args:
        optimizer: any ``torch.optim.Optimizer``, created after ``smp.DistributedModel(model)``
            from ``model.parameters()``.
        static_loss_scale: the fixed scale when ``dynamic_loss_scale`` is False (1.0: a plain
            step, what fp32 and bf16 training want).
        dynamic_loss_scale: adapt the scale (for fp16); see ``DynamicLossScaler`` for the rules.
        dynamic_loss_args: SageMaker's keys ``init_scale`` (2**32), ``scale_factor`` (2.0),
            ``scale_window`` (1000), ``min_scale`` (1.0), ``delayed_shift`` (1),
            ``consecutive_hysteresis`` (False).

    Attributes:
        loss_scaler: the ``LossScaler`` / ``DynamicLossScaler``; ``loss_scaler.loss_scale`` is
            the current scale.
        overflow: whether the last ``step()`` was skipped because of an inf/nan gradient.

    Raises:
        RuntimeError: if ``smp.init()`` was not called.
        ValueError: if the optimizer holds parameters that belong to no ``DistributedModel``, or
            for unknown or invalid ``dynamic_loss_args``; nothing is registered in that case.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Mapping[str, Any] | None = None):
        rt = runtime.current()
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already a DistributedOptimizer; wrap a torch optimizer once")
        _check_owned((p for g in optimizer.param_groups for p in g["params"]), rt)
        self.optimizer = optimizer
        self.loss_scaler = _make_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
        self.overflow = False
        rt.optimizers.append(self)
        if rt.pending_resume is not None:  # smp.resume_from_checkpoint ran before this optimizer existed
            rt.pending_resume.on_optimizer(self)

    # ---- the wrapped optimizer's state, seen as the wrapper's own ---------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def __getattr__(self, name: str):
        # Only reached for names the wrapper lacks (e.g. hooks, optimizer-specific attributes).
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, loss_scaler={self.loss_scaler!r})"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters must belong to a DistributedModel."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_owned(params, runtime.current())
        self.optimizer.add_param_group({**param_group, "params": params})

    # ---- the training step ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Unscale the gradients and step, or skip the step if a rank overflowed.

        With dynamic scaling every rank joins one all-reduce to agree on overflow. A skipped
        step leaves the gradients untouched (still scaled, holding the inf/nan); zero them as
        usual before the next backward. A closure is only accepted without loss scaling, since
        the gradients it produces would come after the unscaling.
        """
        scaler = self.loss_scaler
        if closure is not None and (scaler.dynamic or scaler.loss_scale != 1.0):
            raise ValueError("step(closure) is not supported with loss scaling; call "
                             "model.backward(loss) and then optimizer.step()")
        grads = [g for g in map(local_grad, self._params()) if g is not None]
        self.overflow = scaler.dynamic and scaler.has_overflow(grads)
        if self.overflow:
            scaler.update_scale(True)
            self._log_skip()
            return None
        if scaler.loss_scale != 1.0:
            for g in grads:
                g.div_(scaler.loss_scale)
        out = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        scaler.update_scale(False)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _params(self) -> Iterator[torch.nn.Parameter]:
        return (p for g in self.optimizer.param_groups for p in g["params"])

    def _log_skip(self) -> None:
        if dist.get_rank() == 0:
            logger.info("gradient overflow, skipping step; loss scale now %g",
                        self.loss_scaler.loss_scale)

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (sharded entries as DTensors) and the loss scaler's."""
        return {"optimizer": self.optimizer.state_dict(), "loss_scaler": self.loss_scaler.state_dict()}

    def local_state_dict(self) -> dict[str, Any]:
        """Like ``state_dict()`` with sharded entries as this rank's local tensors (for ``smp.save``)."""
        return local_optimizer_state(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what ``state_dict()`` or ``local_state_dict()`` returned, or ``smp.load`` of it at
        another TP degree (plain tensors become DTensors like their parameters); a plain torch
        optimizer state dict (no loss scaler entry) is also accepted and keeps the current scale."""
        if "optimizer" not in state_dict:
            self.optimizer.load_state_dict(to_param_layout(self.optimizer, state_dict))
            return
        self.optimizer.load_state_dict(to_param_layout(self.optimizer, state_dict["optimizer"]))
        if "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


def _make_scaler(static_loss_scale: float, dynamic: bool, args: Mapping[str, Any] | None) -> LossScaler:
    """The scaler for SageMaker's three arguments; ``dynamic_loss_args`` are checked even when
    unused, so a typo is reported the first time, not when fp16 is switched on."""
    scaler = DynamicLossScaler.from_args(args)
    if dynamic:
        return scaler
    if args:
        logger.warning("dynamic_loss_args ignored because dynamic_loss_scale=False")
    return LossScaler(static_loss_scale)


def _check_owned(params, rt: runtime.Runtime) -> None:
    """Refuse parameters no DistributedModel uses: wrapping replaces a model's parameters with
    sharded ones, so an optimizer built before wrapping would update tensors nothing reads."""
    params = list(params)
    owned = rt.owned_parameter_ids()
    foreign = sum(1 for p in params if id(p) not in owned)
    if foreign:
        raise ValueError(
            f"{foreign} of the optimizer's {len(params)} parameters do not belong to any "
            "smp.DistributedModel. The optimizer must be created after smp.DistributedModel(...), "
            "from model.parameters(): wrapping replaces the model's parameters with sharded ones, "
            "so an optimizer created before wrapping would update tensors the model no longer uses.")
