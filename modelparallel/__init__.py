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
"""

from .checkpoint import (CheckpointError, checkpoint_staging_bytes, last_load_report, resume_from_checkpoint,
                         save_checkpoint, wait_for_checkpoints)
from .checkpoint.sagemaker.legacy import load, save  # SageMaker v1's smp.save / smp.load
from . import delayed_param
from .activations import set_activation_checkpointing
from .clip import clip_grad_norm_
from .config import Config
from . import context
from .sagemaker.cp import gather_sequence, get_batch_for_cp_rank
from .creation import delay_param_initialization, model_creation
from .partitioning import load_hf_checkpoint
from .materialize.meta import MetaTensorError
from .model import DistributedModel
from .models import Architecture, architecture_for, register_architecture
from .optimizer import DistributedOptimizer
from .pipeline import partition, set_partition
from .runtime import (
    CP_GROUP, DP_CP_GROUP, DP_GROUP, MP_GROUP, PP_GROUP, RDP_GROUP, TP_GROUP, WORLD, CommGroup, cp_rank, cp_size,
    dp_rank, dp_size, get_cp_process_group,
    get_dp_process_group, get_mp_process_group, get_pp_process_group, get_rdp_process_group,
    get_tp_process_group, get_world_process_group, is_initialized, local_rank, local_size,
    mp_rank, mp_size, pp_rank, pp_size, rank, rdp_rank, rdp_size, size, tp_rank, tp_size,
)
from .comm import (
    RankType, allgather, barrier, broadcast, cp_mesh, dp_barrier, dp_mesh, expert_dp_mesh, get_cp_group, get_dp_group,
    get_mp_group, get_pp_group, get_rdp_group, get_tp_group, get_world_group, mp_barrier, recv_from, send, tp_mesh,
)
from .sagemaker.state import state
from .step import StepOutput, is_tracing, num_microbatches, step
from .tp.marks import set_tensor_parallelism, tensor_parallelism, tp_register, tp_register_with_module
from .tp.plan import ArchSpec, ModulePlan
from .sagemaker import nn, patches
from .sagemaker.v2.contract import init, transform  # v2's PyTorch patches: see sagemaker/v2/contract.py
import sys as _sys

from .sagemaker import paths as _paths

_paths.register(_sys.modules[__name__])  # modelparallel.moe.moe_config & co.: SageMaker's paths

__version__ = "0.1.0"

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
