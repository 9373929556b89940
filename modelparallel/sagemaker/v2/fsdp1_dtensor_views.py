"""FSDP1 (``FullyShardedDataParallel``) over tensor-parallel DTensor parameters: ties, and the
case without sharding.

**Ties.** FSDP1 finds a parameter held by two modules (an LM head tied to the embedding) by
remembering each parameter it flattens and looking the next holder up. For a DTensor it
remembers the *local tensor* it flattened and looks up the DTensor, so it never finds the tie:
it flattens the tensor twice and the two holders train as independent copies (the model is
silently untied). ``install`` wraps ``FlatParamHandle._init_flat_param_and_metadata``: the
second and later holders of a DTensor are hidden from the walk and recorded afterwards as the
shared parameters (``SharedParamInfo``) FSDP would have recorded.

**No sharding.** FSDP1 falls back to ``NO_SHARD`` when it shards over one rank (tensor
parallelism at data-parallel size 1, the usual layout under context parallelism) and uses it for
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
longer updates. The gradients have the same problem: FSDP's gradient views reshape the flat
gradient to each parameter's global shape (a TP shard's local gradient has its local shape), so
the first backward fails too ("shape '[64, 64]' is invalid for input of size 2048").

``install`` also wraps ``FlatParamHandle._use_unsharded_views`` so that each DTensor parameter is
one object for the life of the model: when FSDP has just re-made a DTensor view of exactly the
memory the recorded parameter already views (same storage, offset, shape, strides, mesh and
placements), the recorded parameter is put back; otherwise (the first time) the new one is
recorded (and flagged as flattened); a tie's other holders get that same object. Without
sharding, gradient views of DTensor parameters are made by FSDP's unsharded-gradient path, which
wraps them as DTensors like the parameters. Nothing else changes: the views are the same memory
either way.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from ...compat import FlatParamHandle, SharedParamInfo, set_fsdp_flattened
from ..wrapping import wrap_once

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
    for k, (name, module, _, prim_name, prim_module, _) in enumerate(flat._shared_param_infos):
        prim = prim_module._parameters.get(prim_name)
        if isinstance(prim, DTensor):  # a tie: every holder holds the primary's object itself
            flat._shared_params[k] = prim
            if module._parameters.get(name) is not prim:
                handle._setattr_param(module, name, prim)


def _hide_dtensor_ties(module, params) -> list[tuple]:
    """Hide (set to None in place) every holder of a DTensor in ``params`` after its first, in
    FSDP's walk order; return ``(SharedParamInfo, parameter)`` for each, to restore and record."""
    wanted = {id(p) for p in params if isinstance(p, DTensor)}
    first: dict[int, tuple] = {}
    hidden = []
    for sub_name, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            if p is None or id(p) not in wanted:
                continue
            if id(p) not in first:
                first[id(p)] = (sub, sub_name, name)
                continue
            prim_module, prim_module_name, prim_name = first[id(p)]
            hidden.append((SharedParamInfo(name, sub, sub_name, prim_name, prim_module, prim_module_name), p))
            sub._parameters[name] = None
    return hidden


def _record_ties(flat, hidden: list[tuple], use_orig_params: bool) -> None:
    """Add the hidden holders to ``flat``'s shared parameters, as FSDP records a found tie: each
    shares the parameter object FSDP recorded for its primary holder (for a DTensor, FSDP keeps
    its own object over the local tensor, not the DTensor)."""
    flat._shared_param_infos = tuple(flat._shared_param_infos) + tuple(info for info, _ in hidden)
    flat._modules = set(flat._modules) | {info.module for info, _ in hidden}
    if use_orig_params:
        index = {(id(m), name): i for i, (name, m, _) in enumerate(flat._param_infos)}
        primaries = [flat._params[index[id(info.prim_module), info.prim_param_name]] for info, _ in hidden]
        flat._shared_params = list(flat._shared_params) + primaries


def _install_tie_detection() -> None:
    def wrap(original):
        def with_dtensor_ties(self, params, module, aligned_numel, use_orig_params):
            hidden = _hide_dtensor_ties(module, params)
            try:
                original(self, params, module, aligned_numel, use_orig_params)
            finally:
                for info, p in hidden:
                    info.module._parameters[info.param_name] = p
            if hidden:
                _record_ties(self.flat_param, hidden, use_orig_params)
        return with_dtensor_ties

    wrap_once(FlatParamHandle, "_init_flat_param_and_metadata", wrap, _MARK)


def _has_dtensor_params(handle) -> bool:
    return any(isinstance(p, DTensor) for p in handle.flat_param._params or ())


def _install_grad_views() -> None:
    """Without sharding, give DTensor parameters DTensor gradient views: FSDP's "sharded" gradient
    views reshape the flat gradient to each parameter's *global* shape, which a TP shard's local
    gradient does not have; its unsharded gradient views go through the DTensor extension."""
    def wrap(original):
        def grad_views(self) -> None:
            if self.uses_sharded_strategy or not _has_dtensor_params(self) or self._offload_params:
                return original(self)
            return self._use_unsharded_grad_views()
        return grad_views

    wrap_once(FlatParamHandle, "_use_sharded_grad_views", wrap, _MARK)


def install() -> None:
    """Wrap the three ``FlatParamHandle`` methods above (idempotent)."""
    _install_tie_detection()
    _install_grad_views()

    def wrap(original):
        def stable_views(self, as_params: bool) -> None:
            original(self, as_params)
            # sharded strategies expose these views only for a while (state dicts,
            # summon_full_params) and then give the modules back their recorded flat-shard
            # parameters: leave them alone
            if as_params and self._use_orig_params and not self.uses_sharded_strategy:
                keep_recorded_params(self)
        return stable_views

    wrap_once(FlatParamHandle, "_use_unsharded_views", wrap, _MARK)
