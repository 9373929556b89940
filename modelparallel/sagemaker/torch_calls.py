"""The call forms of SageMaker's own PyTorch build that its scripts use, given to the ranks of
``modelparallel run`` (``install``).

- ``torch.distributed.init_process_group(backend="smddp")``: SageMaker's data-parallel backend,
  which scripts ask for after ``import smdistributed.dataparallel.torch.torch_smddp``, starts
  NCCL on a machine with CUDA and gloo without. SageMaker's backend is its own collective library
  doing NCCL's job, which outside SageMaker NCCL does itself.
- ``torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict(..., process_group=)``:
  SageMaker's build loads a sharded optimizer state over the process group its checkpoint was
  saved over (the FSDP group: the scripts save each tensor-parallel rank's directory, and under
  hybrid sharding each replica, over it). PyTorch's own function has no such argument and loads
  over the world, so the group is handed to the load it makes. PyTorch's function places the
  state it loads by the model state dict's ShardedTensors; with DTensors in it (tensor
  parallelism) or ShardedTensors over part of the data-parallel ranks (hybrid sharding) the
  loaded state is not the saved one (the resumed losses drift, without an error), so those
  layouts are refused, naming the entry, before anything is read.

Each replacement wraps PyTorch's function once (``__wrapped__`` is PyTorch's) and answers the
call forms PyTorch takes exactly as PyTorch does.
"""

from __future__ import annotations

import contextlib
import functools

from .wrapping import wrap_once

SMDDP = "smddp"
_MARK = "_mp_sagemaker_form"


def smddp_backend() -> None:
    """Let ``torch.distributed.init_process_group`` take SageMaker's backend name."""
    import torch
    import torch.distributed as dist

    def wrap(real):
        def init_process_group(backend=None, *args, **kwargs):
            if isinstance(backend, str) and backend.lower() == SMDDP:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            return real(backend, *args, **kwargs)

        return init_process_group

    wrap_once(dist, "init_process_group", wrap, _MARK)


@contextlib.contextmanager
def _dcp_loads_over(module, group):
    """Inside, ``module``'s DCP ``load_state_dict`` runs over ``group`` (its first rank
    coordinating)."""
    inner = module.load_state_dict
    module.load_state_dict = functools.partial(inner, process_group=group, coordinator_rank=0)
    try:
        yield
    finally:
        module.load_state_dict = inner


def _inexact_layout(model_state_dict) -> str | None:
    """Why PyTorch's sharded optimizer load cannot place state for ``model_state_dict``, or None."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ..compat import ShardedTensor

    for key, value in model_state_dict.items():
        if isinstance(value, DTensor):
            return f"{key!r} is a DTensor (tensor parallelism, or FSDP given a device mesh)"
        if isinstance(value, ShardedTensor):
            group = value._process_group
            if group is not None and dist.get_world_size(group) < dist.get_world_size():
                return f"{key!r} is sharded over {dist.get_world_size(group)} of {dist.get_world_size()} ranks " \
                       "(hybrid sharding)"
    return None


def sharded_optimizer_load_over_group() -> None:
    """Let ``load_sharded_optimizer_state_dict`` take SageMaker's ``process_group=``."""
    from torch.distributed.checkpoint import optimizer as dcp_optimizer

    def wrap(real):
        def load_sharded_optimizer_state_dict(model_state_dict, optimizer_key, storage_reader, planner=None,
                                              process_group=None):
            problem = _inexact_layout(model_state_dict)
            if problem is not None:
                raise NotImplementedError(
                    f"load_sharded_optimizer_state_dict: {problem}: PyTorch's sharded optimizer load would place the "
                    "state wrongly here; load the optimizer state with the model state instead (FSDP.optim_state_dict "
                    "of an optimizer prepared by torch.sagemaker.distributed.checkpoint.state_dict_utils."
                    "init_optim_state, loaded by one DCP load_state_dict call)")
            if process_group is None:
                return real(model_state_dict, optimizer_key, storage_reader, planner)
            with _dcp_loads_over(dcp_optimizer, process_group):
                return real(model_state_dict, optimizer_key, storage_reader, planner)

        return load_sharded_optimizer_state_dict

    wrap_once(dcp_optimizer, "load_sharded_optimizer_state_dict", wrap, _MARK)


def install() -> None:
    """Every call form above, for the rest of this process (idempotent)."""
    smddp_backend()
    sharded_optimizer_load_over_group()
