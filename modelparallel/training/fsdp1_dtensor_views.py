"""FSDP1 without sharding (``NO_SHARD``) over tensor-parallel DTensor parameters.

FSDP1 falls back to ``NO_SHARD`` when it shards over one rank (tensor parallelism at
data-parallel size 1, the usual layout under context parallelism) and uses it for
``hybrid_shard_degree`` 1. Without sharding, ``use_orig_params=True`` exposes each original
parameter as a view of the flat parameter, re-made after every forward and backward. A plain
tensor keeps its ``Parameter`` object (FSDP assigns ``param.data = view``), but a DTensor cannot
take a ``.data`` of another DTensor, so FSDP wraps every new view in a *new* ``Parameter``. The
next forward then sees parameters "changed by the user" (not the objects it recorded), tries to
write them back into the flat parameter through their global shape, and fails: "Cannot writeback
when the parameter shape changes" (evenly sharded TP weights) or "Cannot flatten unevenly
sharded tensor" (a vocabulary TP does not divide). Worse, the new objects lack FSDP's "already
flattened" flag, so the enclosing unit (the root) flattens the inner units' parameters a second
time; and the optimizer, built from the parameters FSDP exposed first, would hold objects FSDP no
longer updates.

The gradients have the same problem: FSDP's gradient views reshape the flat gradient to each
parameter's global shape (a TP shard's local gradient has its local shape), so the first backward
fails too ("shape '[64, 64]' is invalid for input of size 2048").

``install`` wraps ``FlatParamHandle._use_unsharded_views`` so that each DTensor parameter is one
object for the life of the model: when FSDP has just re-made a DTensor view of exactly the memory
the recorded parameter already views (same storage, offset, shape, strides, mesh and
placements), the recorded parameter is put back; otherwise (the first time) the new one is
recorded (and flagged as flattened). Without sharding, gradient views of DTensor parameters are
made by FSDP's unsharded-gradient path, which wraps them as DTensors like the parameters. Nothing
else changes: the views are the same memory either way.
"""

from __future__ import annotations

import functools

from torch.distributed.tensor import DTensor

from ..compat import FlatParamHandle, set_fsdp_flattened

_MARK = "_mp_stable_dtensor_params"


def _same_view(a, b) -> bool:
    """Whether two DTensors are the same view of the same memory with the same layout."""
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        return False
    la, lb = a.to_local(), b.to_local()
    return (la.data_ptr() == lb.data_ptr() and la.shape == lb.shape and la.stride() == lb.stride()
            and la.dtype == lb.dtype and a.placements == b.placements and a.device_mesh == b.device_mesh)


def keep_recorded_params(handle) -> None:
    """After FSDP exposed its unsharded views as parameters: give each module back the recorded
    DTensor parameter where it views the same memory, else record the new one."""
    flat = handle.flat_param
    for i, (name, module, _) in enumerate(flat._param_infos):
        current = module._parameters.get(name)
        if not isinstance(current, DTensor):
            continue
        recorded = flat._params[i]
        if recorded is current:
            continue
        if _same_view(recorded, current):
            handle._setattr_param(module, name, recorded)
        else:
            flat._params[i] = current
            set_fsdp_flattened(current)  # else an enclosing FSDP unit would flatten it a second time


def _has_dtensor_params(handle) -> bool:
    return any(isinstance(p, DTensor) for p in handle.flat_param._params or ())


def _install_grad_views() -> None:
    """Without sharding, give DTensor parameters DTensor gradient views: FSDP's "sharded" gradient
    views reshape the flat gradient to each parameter's *global* shape, which a TP shard's local
    gradient does not have; its unsharded gradient views go through the DTensor extension."""
    original = FlatParamHandle._use_sharded_grad_views
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def grad_views(self) -> None:
        if self.uses_sharded_strategy or not _has_dtensor_params(self) or self._offload_params:
            return original(self)
        return self._use_unsharded_grad_views()

    setattr(grad_views, _MARK, True)
    FlatParamHandle._use_sharded_grad_views = grad_views


def install() -> None:
    """Wrap ``FlatParamHandle._use_unsharded_views`` and ``_use_sharded_grad_views`` (idempotent)."""
    _install_grad_views()
    original = FlatParamHandle._use_unsharded_views
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def stable_views(self, as_params: bool) -> None:
        original(self, as_params)
        # sharded strategies expose these views only for a while (state dicts, summon_full_params)
        # and then give the modules back their recorded flat-shard parameters: leave them alone
        if as_params and self._use_orig_params and not self.uses_sharded_strategy:
            keep_recorded_params(self)

    setattr(stable_views, _MARK, True)
    FlatParamHandle._use_unsharded_views = stable_views
