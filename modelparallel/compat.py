"""Every private PyTorch name this package uses, imported here and nowhere else.

Names that start with ``_`` may change or vanish in any PyTorch release. Keeping them in one
module means an upgrade breaks one import, named by ``tests/test_compat.py``, instead of
failures scattered through the package. Each entry says why the public API does not suffice.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed.device_mesh import DeviceMesh

# The (local shape, global offset) of any mesh coordinate's block, for every placement DTensor
# has (FSDP's strided shard of a TP shard included); the public API only answers for this rank.
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset as compute_local_shape_and_global_offset,
)

# DCP's own rule for turning a nested state dict into checkpoint entry names (and back): the
# keys we compare and load must be exactly the ones DCP wrote.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors as flatten_sharded_tensors

# Puts a non-tensor value read by DCP back at its place in a nested state dict, by the path
# ``flatten_state_dict`` recorded; DCP's planners do the same and export no public helper.
from torch.distributed.checkpoint._traverse import set_element

# FSDP1's sharded state dicts hold their parameters and optimizer slots as ShardedTensors; an
# asynchronous v2 save tells them apart from plain tensors (there is no public name for the type).
from torch.distributed._shard.sharded_tensor import ShardedTensor

# FSDP1 loads optimizer state through this module's ``_gather_state_dict``, which gathers a TP
# shard's state to the global tensor; the FSDP1 x TP resume wraps it to keep the TP-local block.
# PyTorch has no hook for it, so the module itself is patched (the function is imported only so
# that a rename fails here).
from torch.distributed.fsdp import _optim_utils as fsdp_optim_utils
from torch.distributed.fsdp._optim_utils import _gather_state_dict  # noqa: F401 - checked, patched on the module

# FSDP1's full model state dict is made by this module's ``_full_post_state_dict_hook`` (looked up
# on the module at each call); it keeps a DTensor parameter as this rank's DTensor view, where a
# full state dict must hold the whole tensor. The v2 export wraps it (no public hook exists), and
# ``_replace_with_full_state_dict_type``, through which FSDP1 turns any state dict of a NO_SHARD
# unit into a full one, to know which type the user asked for.
from torch.distributed.fsdp import _state_dict_utils as fsdp_state_dict_utils
from torch.distributed.fsdp._state_dict_utils import (  # noqa: F401 - checked, patched on the module
    _full_post_state_dict_hook, _replace_with_full_state_dict_type)

# FSDP1's sharded state dict of a TP DTensor parameter is made by this module's ``_chunk_dtensor``
# (looked up on the module at each call): it shards the TP-local block over the root mesh's
# next-to-last dimension as a plain ``Shard``, which DTensor reads as split *before* TP. The v2
# recipe wraps it to say "after TP" with ``_StridedShard`` (FSDP2's placement for the same
# layout), so each TP rank's FSDP group holds one whole TP block; PyTorch exposes no public name.
from torch.distributed.tensor.parallel import fsdp as tp_fsdp_extension
from torch.distributed.tensor.parallel.fsdp import _chunk_dtensor  # noqa: F401 - checked, patched on the module
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# FSDP1 flattens each unit's parameters in ``FlatParamHandle`` and then keeps this rank's chunk
# (``shard``); between the two the unit's original tensors are dead on ranks other than 0. The
# v2 recipe frees them there so a rank never holds its shards plus a whole unit twice; PyTorch
# exposes no hook at that point. FSDP1 also misses ties between DTensor parameters (it records
# shared parameters by their local tensor, then looks them up by the DTensor): the FSDP1 x TP
# helpers record such ties themselves as ``SharedParamInfo`` entries.
from torch.distributed.fsdp._flat_param import FlatParamHandle, SharedParamInfo

# FSDP1 marks each tensor it has flattened with this flag so an enclosing unit does not flatten it
# again; a parameter object FSDP1 re-creates for a DTensor view (no sharding) lacks it, and the
# FSDP1 x TP helpers set it on the object they keep.
from torch.distributed.fsdp._common_utils import _set_fsdp_flattened as set_fsdp_flattened

# FSDP1 materializes each unit's meta modules with one of these two functions; SageMaker's FSDP
# runs a ``post_param_init_fn`` right after (ties restored before flattening), which PyTorch has
# no argument for, so the v2 contract wraps them on the module (imported only so a rename fails here).
from torch.distributed.fsdp import _init_utils as fsdp_init_utils
from torch.distributed.fsdp._init_utils import _materialize_meta_module, _materialize_with_param_init_fn  # noqa: F401

# PyTorch's activation checkpoint and offload wrappers (``checkpoint_wrapper``, ``offload_wrapper``),
# the ones SageMaker v2 scripts use; with ``sm_activation_offloading`` their forwards run on this
# library's offloader, as SageMaker replaces them. PyTorch ships them only under this private path.
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_checkpoint_wrappers

# DCP's save and load both end in these module functions (``save``, ``load`` and the deprecated
# ``save_state_dict`` / ``load_state_dict`` alike); a DTensor saved over a process group holding
# part of its mesh is turned into the block that group holds around them (DCP has no hook for a
# state dict's layout relative to the group). The modules are patched; the names are imported
# only so that a rename fails here.
from torch.distributed.checkpoint import state_dict_loader as dcp_loader_module
from torch.distributed.checkpoint import state_dict_saver as dcp_saver_module
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: F401
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict  # noqa: F401

# The expert mesh is the world mesh with its data-parallel dimension split in two; only the private
# ``_unflatten`` makes such a mesh share the world mesh's root (FSDP and DTensor then accept
# meshes sliced from both), where a second ``DeviceMesh`` would be an unrelated one.
def unflatten_mesh(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with dimension ``dim`` split into ``names`` of ``sizes`` (``DeviceMesh._unflatten``),
    its new groups with the job's timeout.

    The dimension is handed over by its index: torch 2.11's ``_unflatten`` inverts its check of a
    dimension given by name (it refuses every name the mesh has), and every release takes an index."""
    configs = {name: mesh_group_config(mesh.device_type, size) for name, size in zip(names, sizes)}
    override = {name: c for name, c in configs.items() if c != (None, None)}
    index = mesh_dim_index(mesh, dim)
    return mesh._unflatten(index, sizes, names, backend_override=override or None)


def mesh_dim_index(mesh: DeviceMesh, dim: str) -> int:
    """The index of ``mesh``'s dimension named ``dim``; a ValueError naming the mesh's dimensions
    when it has none of that name."""
    names = tuple(mesh.mesh_dim_names or ())
    if dim not in names:
        raise ValueError(f"mesh has no dimension {dim!r}; its dimensions are {names}")
    return names.index(dim)

# One collective gathering (or reduce-scattering) equal-sized tensors into one tensor. torch 2.13
# named them ``all_gather_single`` / ``reduce_scatter_single`` and deprecated the older names
# (a FutureWarning per call); torch 2.11 has only the older ones. Same arguments in both.
def _first_collective(*names: str):
    import torch.distributed as dist

    return next(getattr(dist, name) for name in names if hasattr(dist, name))


all_gather_single = _first_collective("all_gather_single", "all_gather_into_tensor")
reduce_scatter_single = _first_collective("reduce_scatter_single", "reduce_scatter_tensor")

# The job's key-value store (torchrun's, or the one init_process_group was given): when a peer dies
# mid-collective the process group is broken, and the store is the one channel left through which
# the survivors can tell which rank stopped answering. torch.distributed exposes no public getter.
from torch.distributed.distributed_c10d import _get_default_store as default_store


# The collective timeout of the default process group (the job's: ``init_process_group(timeout=)``).
# ``new_group`` without a timeout gets PyTorch's default (30 minutes for gloo), not the job's: a
# rank whose peer died before creating the group with it waits that long. Read from the group's
# backend options (PyTorch exposes no getter); None when no backend says (the caller then leaves
# PyTorch's default).
def default_group_timeout() -> timedelta | None:
    """The default process group's collective timeout, or None if its backend does not say."""
    import torch.distributed as dist

    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


# Several dimensions of a DeviceMesh as one (the data and context ranks FSDP shards over), kept
# in the root mesh so DTensors on its other dimensions (TP shards) compose with it; PyTorch
# exposes no public name for it yet (``DeviceMesh._flatten``).
def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dimensions as one named ``name`` (created once per root mesh, then reused), its
    group with the job's timeout."""
    config = mesh_group_config(mesh.device_type, mesh.size())
    return mesh._flatten(name, backend_override=None if config == (None, None) else config)


def mesh_group_config(device_type: str, size: int) -> tuple:
    """The ``(backend, options)`` a mesh dimension of ``size`` ranks is created with: on CPU, gloo
    with the default group's timeout, since a mesh's groups otherwise get PyTorch's default (30
    minutes for gloo) where the job asked for its own (a rank waiting on a peer that hangs would
    wait that long). ``(None, None)``, PyTorch's choice, for a dimension of one rank or of the whole
    world (those reuse the default group) and on accelerators (whose default backend may be a
    per-device pair that one backend name would narrow)."""
    import torch.distributed as dist

    timeout = default_group_timeout()
    if device_type != "cpu" or timeout is None or size in (1, dist.get_world_size()):
        return (None, None)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return ("gloo", options)


# DCP's record of where an item's bytes lie in a file (name, offset, length): the save's writer
# writes DCP's files itself and hands DCP the same records for its metadata.
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo  # noqa: E402

# What ``torch.save`` pickles beside a tensor's shape (conjugate / negative bits and the like) and
# the alignment of each storage in its zip: together they decide the bytes ``torch.save`` writes
# around a tensor's data, which the writer reuses only where both say nothing changed.
from torch._utils import get_tensor_metadata  # noqa: E402
from torch.serialization import _get_storage_alignment as storage_alignment  # noqa: E402

# PyTorch's fused CPU attention kernel with its log-sum-exp, and its backward given an output and
# log-sum-exp: context parallelism merges attention blocks by their log-sum-exp and differentiates
# each block against the merged result; ``scaled_dot_product_attention`` returns neither.
flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_attention_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

__all__ = ["FlatParamHandle", "ShardedTensor", "SharedParamInfo", "StorageInfo", "all_gather_single",
           "compute_local_shape_and_global_offset", "dcp_loader_module", "dcp_saver_module",
           "default_group_timeout", "default_store", "flash_attention_cpu", "flash_attention_cpu_backward",
           "flatten_mesh", "flatten_state_dict", "fsdp_init_utils", "fsdp_optim_utils", "fsdp_state_dict_utils",
           "get_tensor_metadata", "mesh_group_config", "reduce_scatter_single", "set_element",
           "set_fsdp_flattened", "storage_alignment", "StridedShard", "tp_fsdp_extension",
           "torch_checkpoint_wrappers", "unflatten_mesh"]
