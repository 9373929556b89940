"""SageMaker v2's ``init`` and ``transform``: the engine's, plus what v2 scripts get in the PyTorch
calls they make themselves, as patches to PyTorch that only these two entry points install (a v1
job, started through ``smdistributed.modelparallel.torch``, gets none of them):

- from ``init``: the data-parallel layout of the script's own FSDP1 call (``fsdp1``, with its
  DTensor views), FSDP1's ``offload_to_cpu`` state dicts on a CPU job (``fsdp1_cpu``), and ``sm_activation_offloading`` through PyTorch's ``offload_wrapper`` (a no-op
  unless the key is set);
- from ``transform`` as well (it may start the job itself): DCP saves over the FSDP (or
  replication) group naming its coordinator by global rank, each TP rank's block over that group
  (``distributed.checkpoint.group_blocks``), and FSDP1 state dicts of tensor-parallel parameters
  (``fsdp1_tp_state``: users wrap the result in FSDP1 and resume through DCP).

Every patch is idempotent and reads the running job when PyTorch calls it, never at install time.
"""

from __future__ import annotations

import functools

from ... import runtime
from ...meshes import layout_key
from ...activations import offload_wrapper
from ...distributed.checkpoint import group_blocks
from ...transform import transform as _transform
from . import fsdp1, fsdp1_cpu, fsdp1_stages, fsdp1_tp_state


def _fsdp1_layout() -> fsdp1.Layout | None:
    """The running job's layout for FSDP1 calls, or None without a job."""
    if not runtime.is_initialized():
        return None
    rt = runtime.current()
    return fsdp1.Layout(rt.replica_mesh, rt.config.tensor_parallel_degree, rt.config.hybrid_shard_degree,
                        rt.expert_replica_mesh, rt.mesh_cache, layout_key(rt.expert_mesh))


def install_init_patches() -> None:
    """The FSDP1 layout contract and activation offloading through ``offload_wrapper``."""
    offload_wrapper.install()
    fsdp1.install(_fsdp1_layout)
    fsdp1_cpu.install()


def install_transform_patches() -> None:
    """``init``'s patches, DCP's group blocks, FSDP1 state dicts of TP parameters and FSDP1's
    optimizer state dicts of a pipeline stage."""
    install_init_patches()
    group_blocks.install()
    fsdp1_tp_state.install()
    fsdp1_stages.install()


@functools.wraps(runtime.init, assigned=("__doc__",))  # its own name: pickles find this one
def init(config: dict | str | None = None, *, timeout_s: float = 300.0) -> runtime.Runtime:
    rt = runtime.init(config, timeout_s=timeout_s)
    install_init_patches()
    return rt


@functools.wraps(_transform, assigned=("__doc__",))
def transform(model, *args, **kwargs):
    install_transform_patches()
    return _transform(model, *args, **kwargs)
