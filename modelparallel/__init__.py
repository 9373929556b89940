"""modelparallel: SageMaker-style model parallelism for Hugging Face transformers on plain PyTorch.

``import modelparallel as smp`` gives the familiar names: ``smp.init``, ``smp.DistributedModel``,
``smp.DistributedOptimizer``, ``smp.tensor_parallelism``, ``smp.tp_register_with_module`` and the
rank API (``smp.rank()``, ``smp.tp_rank()``, ``smp.dp_size()``...).

The engine (runtime, meshes, tp/, pipeline/, context/, expert/, training/, materialize/,
checkpoint/, models/) imports nothing from the SageMaker compatibility surface
(``modelparallel/sagemaker/``: SageMaker's module paths, v1's and v2's entry points and v2's
PyTorch patches); this module puts the two together. ``init`` and ``transform`` here are SageMaker
v2's (they install its PyTorch patches, which a v2 script imported as ``modelparallel`` needs);
SageMaker v1's path ``smdistributed.modelparallel.torch`` gives the engine's ``init``.

A Hugging Face architecture modelparallel does not know gets its data with
``smp.register_architecture(ConfigClass, smp.Architecture(spec=smp.ArchSpec(...), table=...))``:
its tensor-parallel plan, and optionally its state-dict key table, pipeline split, context and
expert data (``smp.architecture_for(model)`` shows the record a model gets).

Every name is imported on first use (``EXPORTS`` says from where), not by ``import modelparallel``:
the engine costs seconds to import (torch, DTensor, transformers), and the ``modelparallel``
command's launcher, which only parses arguments and starts ranks, would pay them before every
launch (``modelparallel.cli`` is a subpackage, so this module runs first). Importing a module of
the engine has no effect a user relies on (v2's PyTorch patches are installed by ``init`` and
``transform``, not by their import), so nothing here needs to be eager. SageMaker's module paths
under this package (``modelparallel.moe.moe_config``...) resolve on import too (``sagemaker/paths.py``).
"""

import importlib as _importlib
import sys as _sys
import types as _types

from .sagemaker import paths as _paths

__version__ = "0.1.0"

_FROM: dict[str, str] = {
    ".checkpoint": "CheckpointError checkpoint_staging_bytes last_load_report resume_from_checkpoint "
                   "save_checkpoint wait_for_checkpoints",
    ".checkpoint.sagemaker.legacy": "load save",  # SageMaker v1's smp.save / smp.load
    ".activations": "set_activation_checkpointing",
    ".clip": "clip_grad_norm_",
    ".config": "Config",
    ".sagemaker.cp": "gather_sequence get_batch_for_cp_rank",
    ".creation": "delay_param_initialization model_creation",
    ".partitioning": "load_hf_checkpoint",
    ".materialize.meta": "MetaTensorError",
    ".model": "DistributedModel",
    ".models": "Architecture architecture_for register_architecture",
    ".optimizer": "DistributedOptimizer",
    ".pipeline": "partition set_partition",
    ".runtime": "CP_GROUP DP_CP_GROUP DP_GROUP MP_GROUP PP_GROUP RDP_GROUP TP_GROUP WORLD CommGroup cp_rank "
                "cp_size dp_rank dp_size get_cp_process_group get_dp_process_group get_mp_process_group "
                "get_pp_process_group get_rdp_process_group get_tp_process_group get_world_process_group "
                "is_initialized local_rank local_size mp_rank mp_size pp_rank pp_size rank rdp_rank rdp_size "
                "size tp_rank tp_size",
    ".comm": "RankType allgather barrier broadcast cp_mesh dp_barrier dp_mesh expert_dp_mesh get_cp_group "
             "get_dp_group get_mp_group get_pp_group get_rdp_group get_tp_group get_world_group mp_barrier "
             "recv_from send tp_mesh",
    ".sagemaker.state": "state",
    ".step": "StepOutput is_tracing num_microbatches step",
    ".tp.marks": "set_tensor_parallelism tensor_parallelism tp_register tp_register_with_module",
    ".tp.plan": "ArchSpec ModulePlan",
    ".sagemaker.v2.contract": "init transform",  # v2's PyTorch patches: see sagemaker/v2/contract.py
}

_MODULES: dict[str, str] = {
    "delayed_param": ".delayed_param", "context": ".context",
    **{top: f".sagemaker.{top}" for top in _paths.MIRRORED if top not in _paths.KEPT_AS_ATTRIBUTE},
}
"""Submodules that are public names: the engine's ``delayed_param`` and ``context``, and SageMaker's
mirrored modules (``smp.nn``, ``smp.patches``, ``smp.moe``...), the same objects as their paths."""

EXPORTS: dict[str, tuple[str, str | None]] = {
    **{name: (module, name) for module, names in _FROM.items() for name in names.split()},
    **{name: (module, None) for name, module in _MODULES.items()},
}
"""Public name -> (module relative to this package, attribute of it; None: the module itself)."""

_SHADOWED = frozenset({"step", "transform"})
"""Public names that are also this package's submodules (``step.py``, ``transform.py``): the name
must stay the function, though importing the submodule sets the package's attribute to it."""

__all__ = [
    "Architecture", "ArchSpec", "CheckpointError", "Config", "DistributedModel", "DistributedOptimizer", "ModulePlan",
    "DP_GROUP", "MP_GROUP", "PP_GROUP", "RDP_GROUP", "TP_GROUP", "WORLD", "CommGroup", "RankType",
    "StepOutput", "allgather", "dp_barrier", "dp_mesh", "expert_dp_mesh", "get_dp_group", "get_mp_group",
    "get_pp_group", "get_pp_process_group", "get_rdp_group", "get_tp_group", "get_world_group", "is_tracing",
    "mp_barrier", "num_microbatches", "recv_from", "send", "state", "step", "tp_mesh",
    "barrier", "broadcast", "dp_rank", "dp_size", "get_dp_process_group", "get_mp_process_group",
    "get_rdp_process_group", "get_tp_process_group", "get_world_process_group", "init",
    "is_initialized", "local_rank", "local_size", "mp_rank", "mp_size", "pp_rank", "pp_size", "rank",
    "rdp_rank", "rdp_size", "set_tensor_parallelism", "size", "tensor_parallelism", "tp_rank",
    "tp_register", "tp_register_with_module", "tp_size", "nn",
    "last_load_report", "resume_from_checkpoint", "save_checkpoint", "wait_for_checkpoints",
    "checkpoint_staging_bytes",
    "MetaTensorError", "delay_param_initialization", "delayed_param", "load_hf_checkpoint", "model_creation",
    "transform", "clip_grad_norm_",
    "patches", "set_activation_checkpointing", "partition", "set_partition",
    "CP_GROUP", "DP_CP_GROUP", "context", "cp_rank", "cp_size", "cp_mesh", "gather_sequence", "get_batch_for_cp_rank",
    "get_cp_group", "get_cp_process_group", "architecture_for", "register_architecture",
]


def __getattr__(name: str):
    """A public name, imported now and kept; else any submodule (``smp.runtime``), as the package
    gave when it imported everything at once."""
    if name in EXPORTS:
        module, attr = EXPORTS[name]
        value = _importlib.import_module(module, __name__)
        if attr is not None:
            value = getattr(value, attr)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists and something it imports is missing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))


class _Package(_types.ModuleType):
    """This module's type: the import system binds a submodule to its name on the package after
    loading it, which must not replace the function of the same name (``_SHADOWED``)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _SHADOWED and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
_paths.register(_sys.modules[__name__])  # modelparallel.moe.moe_config & co.: SageMaker's paths
