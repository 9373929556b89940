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

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import marks
from ..plan import ArchSpec
from .hf_plan import candidate
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


def automatic_spec(model: nn.Module, tp_mesh: DeviceMesh, parallelize) -> ArchSpec:
    """``model``'s plan, verified over ``tp_mesh`` (a collective): transformers' own plan where it
    has one that verifies (``hf_plan.candidate``), else the derived plan. A plan whose shared
    inputs (one ``f`` for several column layers) do not verify is tried once without them.

    Raises:
        AutoPlanError: naming the module that cannot be placed or whose output or gradient differs.
    """
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


def plan_for(model: nn.Module, record, tp_mesh: DeviceMesh, parallelize) -> ArchSpec | None:
    """The plan ``model`` is sharded with: its architecture ``record``'s (``models.Architecture``)
    if any, else the automatic plan (at a degree above 1, for a model it ``applies`` to), else None."""
    builtin = record.spec if record is not None else None
    if builtin is not None or tp_mesh.size() == 1 or not applies(model):
        return builtin
    spec = automatic_spec(model, tp_mesh, parallelize)
    logger.info("automatic tensor-parallel plan for %s (no architecture record): %s",
                type(model).__name__, ", ".join(f"{k} -> {v}" for k, v in spec.base.rules.items()))
    return spec
