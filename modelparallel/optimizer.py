"""``DistributedOptimizer``: SageMaker's optimizer wrapper: loss scaling and fp32 master weights.

The wrapped optimizer does the update; the wrapper (1) owns the loss scale that
``DistributedModel.backward`` multiplies the loss by, (2) with dynamic scaling, skips the update on
every rank when any rank saw an inf/nan gradient, (3) for fp16/bf16 parameters keeps an fp32
master copy of each (``master_weights``), steps the wrapped optimizer on the masters so its
state is fp32, unscales the gradients into them, steps, and rounds the result back into the
model, and (4) clips the master gradients by their global norm (``clip_master_grads``).
Sharded parameters are DTensors, and so are the ones kept whole beside them (``Replicate()``), so
an unmodified ``torch.optim`` optimizer updates each rank's shard, with its for-loop, ``foreach``
or ``fused`` kernels alike; nothing else is needed for tensor parallelism. What wrapping refuses
(foreign parameters, fused kernels DTensor lacks) is checked in ``optimizer_checks``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import partitioning, runtime
from .optimizer_checks import _owners, check_fused
from .training import optimizer_state
from .training.dp import local_grad
from .pipeline.ties import norm_holders
from .training.grad_clip import clip_by_global_norm
from .training.loss_scaler import DynamicLossScaler, LossScaler
from .training.master_weights import MasterWeights

logger = logging.getLogger("modelparallel")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` (built from a ``DistributedModel``'s parameters) with loss scaling and,
    for half-precision parameters, fp32 master weights.

    It subclasses ``torch.optim.Optimizer`` so learning-rate schedulers accept it, but does not
    call its constructor: the wrapped optimizer keeps the one copy of ``param_groups`` and
    ``state``, which the wrapper exposes as its own (keyed by the model's parameters). When the
    parameters are fp16 or bf16 (``"fp16": true`` / ``"bf16": true``), the state is fp32 and
    each has an fp32 master (``master_weights.master_of(p)``), which is what is stepped.

    Args:
        optimizer: any ``torch.optim.Optimizer``, created after ``smp.DistributedModel(model)``
            from ``model.parameters()``.
        static_loss_scale: the fixed scale when ``dynamic_loss_scale`` is False (1.0: a plain
            step, what fp32 and bf16 training want). ``None`` means 1.0.
        dynamic_loss_scale: adapt the scale (for fp16); see ``DynamicLossScaler`` for the rules.
        dynamic_loss_args: SageMaker's keys ``init_scale`` (2**32), ``scale_factor`` (2.0),
            ``scale_window`` (1000), ``min_scale`` (1.0), ``delayed_shift`` (1),
            ``consecutive_hysteresis`` (False).

    Attributes:
        loss_scaler: the ``LossScaler`` / ``DynamicLossScaler``; ``loss_scaler.loss_scale`` is
            the current scale.
        overflow: whether the last ``step()`` was skipped because of an inf/nan gradient.
        master_weights: the ``MasterWeights`` of the half-precision parameters (empty if none).

    Raises:
        RuntimeError: if ``smp.init()`` was not called.
        ValueError: if the optimizer holds parameters that belong to no ``DistributedModel``,
            for unknown or invalid ``dynamic_loss_args``, or if the parameters are half
            precision and the optimizer cannot keep fp32 masters (named); nothing is registered
            in that case.
        NotImplementedError: for ``fused=True`` where DTensor has no rule for the fused kernel
            (``check_fused``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float | None = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Mapping[str, Any] | None = None):
        rt = runtime.current()
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already a DistributedOptimizer; wrap a torch optimizer once")
        for group in optimizer.param_groups:  # parameters of a model whose split waited for the marks
            for model in rt.models:
                split = partitioning.remap(model, group["params"])
                group["params"] = group["params"] if split is None else split
        owners = _owners((p for g in optimizer.param_groups for p in g["params"]), rt.models)
        check_fused(type(optimizer), optimizer.param_groups)
        scaler = _make_scaler(1.0 if static_loss_scale is None else static_loss_scale,
                              dynamic_loss_scale, dynamic_loss_args)
        self.master_weights = MasterWeights(optimizer)
        self.optimizer = optimizer
        self.loss_scaler = scaler
        self.overflow = False
        self._grads_ready = False
        self.models: list = []
        """The ``DistributedModel``s whose parameters this optimizer holds, linked both ways."""
        self._link(owners)
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

    @property
    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """SageMaker's name for the model's parameters per group, in ``param_groups`` order
        (whatever their dtype): checkpoint helpers map them to names and global shapes
        (a sharded parameter's ``shape`` is its global one)."""
        return [list(group["params"]) for group in self.optimizer.param_groups]

    def __getattr__(self, name: str):
        # Only reached for names the wrapper lacks (e.g. hooks, optimizer-specific attributes).
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({self.optimizer!r}, loss_scaler={self.loss_scaler!r}, "
                f"fp32_masters={len(self.master_weights)})")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters must belong to a DistributedModel
        (half-precision ones get fp32 masters like the others)."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owners = _owners(params, runtime.current().models)
        check_fused(type(self.optimizer), [{**self.optimizer.defaults, **param_group, "params": params}])
        self.optimizer.add_param_group({**param_group, "params": params})
        self.master_weights.adopt_group(self.optimizer.param_groups[-1])
        self._link(owners)

    def _link(self, models) -> None:
        """Link this optimizer and the models holding its parameters, each way."""
        for model in models:
            if model not in self.models:
                self.models.append(model)
            model.link_optimizer(self)

    # ---- the training step ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Unscale the gradients (into the fp32 masters, if any) and step, or skip the step if a
        rank overflowed; then round the masters back into the model's parameters.

        With dynamic scaling every rank joins one all-reduce to agree on overflow. A skipped
        step leaves the model's gradients untouched (still scaled, holding the inf/nan); zero
        them as usual before the next backward. A closure is only accepted without loss scaling
        and master weights, since the gradients it produces would come after the unscaling.
        """
        scaler = self.loss_scaler
        if closure is not None and (scaler.dynamic or scaler.loss_scale != 1.0 or len(self.master_weights)):
            raise ValueError("step(closure) is not supported with loss scaling or fp32 master weights; "
                             "call model.backward(loss) and then optimizer.step()")
        if not self._prepare_grads():
            scaler.update_scale(True)
            self._log_skip()
            return None
        with self.master_weights.masters_in_optimizer() as inner:
            out = inner.step() if closure is None else inner.step(closure)
        self.master_weights.masters_to_params()
        self.master_weights.clear_master_grads()
        self._grads_ready = False
        scaler.update_scale(False)
        return out

    def _prepare_grads(self) -> bool:
        """Once per step: agree on overflow, then unscale the gradients into what the optimizer
        steps (masters, or the parameters themselves). Returns False if the step must be skipped."""
        if self._grads_ready:
            return not self.overflow
        scaler = self.loss_scaler
        grads = [g for g in map(local_grad, self._model_params()) if g is not None]
        self.overflow = scaler.dynamic and scaler.has_overflow(grads)
        if self.overflow:
            self.master_weights.clear_master_grads()
            return False
        self.master_weights.grads_to_masters(scaler.loss_scale)
        self._grads_ready = True
        return True

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip the fp32 master gradients (the unscaled gradients, without masters) so that
        their global norm is at most ``max_norm``; call it after ``model.backward`` and before
        ``step()``. The norm counts every element of the whole model once: TP shards summed over
        the TP group, replicated parameters and data-parallel replicas counted once. A
        collective: every rank must call it.

        Returns:
            The global norm before clipping (an fp32 scalar tensor, equal on every rank); inf if
            a rank overflowed (the coming ``step()`` will be skipped, nothing is clipped).
        """
        if not self._prepare_grads():
            return torch.tensor(float("inf"))
        pairs = list(self.master_weights.params_and_masters())
        held = norm_holders([m.module for m in self.models], dist.get_world_size())  # pipeline stages
        by_step = {id(t): held[id(p)] for p, t in pairs if id(p) in held}
        return clip_by_global_norm((t for _, t in pairs), max_norm, norm_type,
                                   holders=(lambda t: by_step.get(id(t), dist.get_world_size())) if by_step else None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.master_weights.clear_master_grads()
        self._grads_ready = False

    def _model_params(self) -> Iterator[torch.nn.Parameter]:
        return (p for g in self.optimizer.param_groups for p in g["params"])

    def _log_skip(self) -> None:
        if dist.get_rank() == 0:
            logger.info("gradient overflow, skipping step; loss scale now %g",
                        self.loss_scaler.loss_scale)

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state in SageMaker's layout: ``state`` (per parameter index, sharded
        entries as DTensors at their global shapes), ``param_groups``, ``_smp_is_partial``
        (False), plus ``loss_scaler`` and ``fp32_from_fp16`` (the fp32 masters by index). No
        collective: DTensors are gathered only by whoever saves them."""
        return optimizer_state.state_dict(self, partial=False)

    def local_state_dict(self) -> dict[str, Any]:
        """Like ``state_dict()`` with sharded entries as this rank's local tensors and
        ``_smp_is_partial`` True (what ``smp.save(..., partial=True)`` stores)."""
        return optimizer_state.state_dict(self, partial=True)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what ``state_dict()`` or ``local_state_dict()`` returned, or ``smp.load`` of it at
        another TP degree (plain tensors become DTensors like their parameters); a plain torch
        optimizer state dict (no loss scaler entry) is also accepted and keeps the current scale.
        Without saved fp32 masters, the masters are recreated from the model's weights (logged).
        Waits for an asynchronous save still copying the optimizer state first."""
        from .checkpoint.api import wait_for_staging

        wait_for_staging()
        optimizer_state.load_state_dict(self, state_dict)
        self._grads_ready = False


def _make_scaler(static_loss_scale: float, dynamic: bool, args: Mapping[str, Any] | None) -> LossScaler:
    """The scaler for SageMaker's three arguments; ``dynamic_loss_args`` are checked even when
    unused, so a typo is reported the first time, not when fp16 is switched on."""
    scaler = DynamicLossScaler.from_args(args)
    if dynamic:
        return scaler
    if args:
        logger.warning("dynamic_loss_args ignored because dynamic_loss_scale=False")
    return LossScaler(static_loss_scale)
