"""The automatic plan: tensor parallelism for a Hugging Face model with no architecture record
(no file in ``modelparallel/models``, none registered): transformers' own ``base_model_tp_plan``
where it verifies (``hf_plan.candidate``), else one found on a proxy (``plan.derive``), verified
over the TP ranks before any weight of the user's model is touched (``verify.verify``).

``plan_for`` is what ``DistributedModel`` and ``transform`` ask: the built-in plan when there is
one, the automatic plan for an HF model without one, or None for a model that steers tensor
parallelism itself (registered modules, ``smp.nn`` modules, parts marked
``tensor_parallelism(enabled=False)``) or runs at degree 1.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import marks
from ..plan import ArchSpec
from .hf_plan import candidate, gathering_inputs
from .plan import AutoPlanError, check_inputs, derive
from .verify import verify

logger = logging.getLogger("modelparallel")

__all__ = ["AutoPlanError", "applies", "automatic_spec", "plan_for"]


def applies(model: nn.Module) -> bool:
    """Whether ``model`` is one the automatic plan serves: an HF model (a config with a
    ``model_type`` and an input embedding) that nothing inside steers by hand."""
    config = getattr(model, "config", None)
    if not getattr(config, "model_type", None) or not hasattr(model, "get_input_embeddings"):
        return False
    if not marks.is_enabled(model, ""):
        return False
    from ..modules import DistributedModule

    for module in model.modules():
        mark = module.__dict__.get("_mp_tp")
        if (mark is not None and not mark.enabled) or marks.registration_of(module) is not None \
                or isinstance(module, DistributedModule):
            return False
    return True


def automatic_spec(model: nn.Module, tp_mesh: DeviceMesh, parallelize, sequence_parallel: bool = False) -> ArchSpec:
    """``model``'s plan, verified over ``tp_mesh`` (a collective): transformers' own plan where it
    has one that verifies (``hf_plan.candidate``), else the derived plan. A plan whose shared
    inputs (one ``f`` for several column layers) do not verify is tried once without them. With
    ``sequence_parallel`` the plan found is verified again under it (``with_sequence_parallel``).

    Raises:
        AutoPlanError: naming the module that cannot be placed or whose output or gradient differs.
        NotImplementedError: sequence parallelism asked of a model the plan does not reproduce under it.
    """
    spec = _verified(model, tp_mesh, parallelize)
    return with_sequence_parallel(model, spec, tp_mesh, parallelize) if sequence_parallel else spec


def with_sequence_parallel(model: nn.Module, spec: ArchSpec, tp_mesh: DeviceMesh, parallelize) -> ArchSpec:
    """``spec`` marked as running under sequence parallelism, once a proxy sharded with it
    (hidden states split along the sequence between the blocks' TP regions) reproduces the
    unsharded one. A module of a block that reads its input's [batch, seq] (an attention
    reshaping a fused projection's output) needs the sequence gathered at its entry: where the
    plan as it is does not verify, it is tried once with a shared input at every module holding
    column layers (``hf_plan.gathering_inputs``)."""
    tp, split = tp_mesh.size(), partial(parallelize, sequence_parallel=True)
    seq = -(-8 // tp) * tp  # a probe sequence the degree divides
    tried = [replace(spec, sequence_parallel=True)]
    gathering = gathering_inputs(model, spec)
    if gathering != spec.base.shared_inputs:
        tried.append(replace(tried[0], base=replace(spec.base, shared_inputs=gathering)))
    found = None
    for candidate_spec in tried:
        found = verify(model, candidate_spec, tp_mesh, split, seq=seq)
        if found is None:
            logger.info("automatic plan of %s verified under sequence parallelism", type(model).__name__)
            return candidate_spec
    raise NotImplementedError(f"sequence_parallel for {type(model).__name__} on the automatic tensor-parallel plan "
                              f"is not implemented: the plan does not reproduce the model under sequence parallelism "
                              f"({found.what} differs by {found.worst:.3g}, rounding allows {found.allowed:.3g})")


def _verified(model: nn.Module, tp_mesh: DeviceMesh, parallelize) -> ArchSpec:
    """The plan without sequence parallelism (see ``automatic_spec``)."""
    hf = candidate(model, tp_mesh.size())
    if hf is not None:
        check_inputs(model, tp_mesh.size())
        plain = replace(hf, base=replace(hf.base, shared_inputs={}))
        for spec in (hf, plain) if hf.base.shared_inputs else (hf,):
            if verify(model, spec, tp_mesh, parallelize) is None:
                logger.info("automatic plan of %s: transformers' base_model_tp_plan", type(model).__name__)
                return spec
    spec = derive(model, tp_mesh.size()).spec
    found = verify(model, spec, tp_mesh, parallelize)
    if found is not None and spec.base.shared_inputs:
        plain = replace(spec, base=replace(spec.base, shared_inputs={}))
        if verify(model, plain, tp_mesh, parallelize) is None:
            logger.info("automatic plan of %s: shared column inputs dropped (%s)", type(model).__name__, found.what)
            return plain
    if found is not None:
        raise AutoPlanError(f"{type(model).__name__}: the automatic plan does not reproduce the unsharded model: "
                            f"{found.what} differs by {found.worst:.3g} (rounding allows {found.allowed:.3g})")
    return spec


def plan_for(model: nn.Module, record, tp_mesh: DeviceMesh, parallelize,
             sequence_parallel: bool = False) -> ArchSpec | None:
    """The plan ``model`` is sharded with: its architecture ``record``'s (``models.Architecture``)
    if any, else the automatic plan (at a degree above 1, for a model it ``applies`` to; verified
    under ``sequence_parallel`` too when asked), else None."""
    builtin = record.spec if record is not None else None
    if builtin is not None or tp_mesh.size() == 1 or not applies(model):
        return builtin
    spec = automatic_spec(model, tp_mesh, parallelize, sequence_parallel)
    logger.info("automatic tensor-parallel plan for %s (no architecture record): %s",
                type(model).__name__, ", ".join(f"{k} -> {v}" for k, v in spec.base.rules.items()))
    return spec
