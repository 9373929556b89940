"""SageMaker v2's ``torch.sagemaker.distributed.checkpoint.state_dict_loader.load``: DCP's load over
a process group, checked first.

Before any tensor is read, every rank checks the checkpoint against its state dict: every key
present, every tensor the saved shape (global shape for DTensors and ShardedTensors, the local
shape for a local state dict), and for a local (``SM_LOCAL_STATE_DICT``) state dict the sharding
it was saved with. The ranks agree on the outcome, so a mismatch on one rank raises on all of
them, naming the keys, before any collective of the load itself.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import LoadPlanner, StorageReader, load as dcp_load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...compat import flatten_state_dict
from ...utils.utils import paused_gc
from . import saving
from .async_utils import wait_for_staging
from .filesystem import DistributedFileSystemReader
from .group_blocks import for_group
from .state_dict_utils import LOCAL_LAYOUT_FILE, local_layouts

__all__ = ["load"]


def _problems(state_dict, metadata, check_keys: bool) -> list[str]:
    flat, _ = flatten_state_dict(state_dict)
    saved = metadata.state_dict_metadata
    out = []
    for key, value in flat.items():
        if key not in saved:
            if check_keys:
                out.append(f"{key}: not in the checkpoint")
            continue
        if torch.is_tensor(value):
            md = saved[key]
            if not isinstance(md, TensorStorageMetadata):
                out.append(f"{key}: saved as an object, asked for as a tensor")
            elif tuple(md.size) != tuple(value.size()):
                out.append(f"{key}: saved with shape {tuple(md.size)}, this rank asks for {tuple(value.size())}")
    return out


def _layout_problems(state_dict, path: str | None) -> list[str]:
    """A local state dict against the layout recorded when it was saved."""
    wanted = local_layouts(state_dict)
    if not wanted or path is None or not os.path.exists(os.path.join(path, LOCAL_LAYOUT_FILE)):
        return []
    with open(os.path.join(path, LOCAL_LAYOUT_FILE)) as f:
        saved = json.load(f)
    out = []
    for key, layout in wanted.items():
        old = saved.get(key)
        for name in ("fsdp_shard_degree", "tensor_parallel_degree"):
            if old is not None and old.get(name) != layout.get(name):
                out.append(f"{key or 'state dict'}: a local checkpoint saved with {name} {old.get(name)} loads only "
                           f"into the same sharding; this job has {layout.get(name)} (the number of replicas may "
                           "change; save a sharded SHARDED_STATE_DICT checkpoint to change the sharding)")
    return out


@paused_gc()
def load(state_dict, *, checkpoint_id: str | os.PathLike | None = None, storage_reader: StorageReader | None = None,
         planner: LoadPlanner | None = None, process_group: dist.ProcessGroup | None = None,
         check_keys_matched: bool = True, coordinator_rank: int = 0, s3_region: str | None = None,
         s3client_config=None) -> None:
    """Load a checkpoint into ``state_dict``'s tensors, in place (and its plain values).

    Args:
        state_dict: what to load: ``{"model": model.state_dict(), "optimizer": ...}`` under the
            state dict type it was saved with.
        checkpoint_id: the checkpoint directory (or give ``storage_reader``).
        storage_reader: e.g. ``DistributedFileSystemReader(path)``.
        planner: a DCP ``LoadPlanner`` (default: ``DefaultLoadPlanner``).
        process_group: the ranks that saved it together (default: the world); only they call this.
        check_keys_matched: every key of ``state_dict`` must be in the checkpoint.
        coordinator_rank: a global rank of ``process_group`` (any member coordinates the same).

    Raises:
        ValueError: on every rank of the group, naming each key whose shape or sharding differs
            (or that is missing), before anything is read; a coordinator outside the group.
        NotImplementedError: S3 options.
    """
    if s3_region is not None or s3client_config is not None:
        raise NotImplementedError("s3_region / s3client_config: S3 checkpoints are not built here")
    group = saving.group_of(process_group, coordinator_rank)
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("load needs checkpoint_id (a directory) or storage_reader")
        storage_reader = DistributedFileSystemReader(checkpoint_id)
    elif checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    path = getattr(storage_reader, "path", None)
    wait_for_staging()  # a save still copying from these tensors must finish that first
    with for_group(state_dict, group.pg):
        error = None
        try:
            problems = _layout_problems(state_dict, None if path is None else os.fspath(path))
            problems += _problems(state_dict, storage_reader.read_metadata(), check_keys_matched)
            if problems:
                error = ValueError(f"checkpoint {path}: " + "; ".join(problems))
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = e
        saving.collective_outcome(group, error, "checkpoint load (checks)")
        dcp_load(state_dict, storage_reader=storage_reader, planner=planner, process_group=group.pg)
