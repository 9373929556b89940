"""SageMaker v2's ``torch.sagemaker.distributed.checkpoint.state_dict_saver``: ``save``,
``async_save`` and ``maybe_finalize_async_calls``.

Both saves write what ``torch.distributed.checkpoint.save`` writes (DCP files plus
``.metadata``), over the ``process_group`` given, by its ranks only: a sharded
(``SHARDED_STATE_DICT``) save with the FSDP group into each tensor-parallel rank's directory, or
a local (``SM_LOCAL_STATE_DICT``) save with a replication group into each shard's directory (its
replicas hold the same tensors, so one of them writes). ``async_save`` returns once the tensors
a forward may change are copied to host memory, the others (only an optimizer step changes them)
being copied by the writer thread while every optimizer's next step waits; see ``async_utils``
for finalizing. ``save`` copies nothing: it writes from the tensors and returns when done.

The queue of calls that name none (SageMaker's ``DEFAULT_ASYNC_REQUEST_QUEUE``), with the plan
cache that lets a repeated save of one structure skip DCP's global planning, belongs to the job:
it is held by the runtime ``init`` made, so a new job starts with an empty one.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist
from torch.distributed.checkpoint import SavePlanner, StorageWriter

from ... import runtime
from ...checkpoint.paused_gc import paused_gc
from . import directories, directory, saving, stages
from .async_utils import AsyncCallsQueue
from .state_dict_utils import LOCAL_LAYOUT_FILE, local_layouts

__all__ = ["AsyncCallsQueue", "PyTorchDistSaveShardedStrategy", "async_save", "maybe_finalize_async_calls", "save"]

def _default_queue(create: bool = True) -> AsyncCallsQueue | None:
    """SageMaker's ``DEFAULT_ASYNC_REQUEST_QUEUE``: the job's queue of calls that name none, made
    at its first use (``create``); None outside a job (no ``init``)."""
    if not runtime.is_initialized():
        return None
    job = runtime.current()
    if job.checkpoint_queue is None and create:
        job.checkpoint_queue = AsyncCallsQueue()
    return job.checkpoint_queue


class PyTorchDistSaveShardedStrategy:
    """SageMaker's default ``sharded_strategy``: the checkpoint in DCP's own file layout, which
    is how both saves here write. Scripts import it (and may pass an instance, with the
    arguments of the strategy it stands for, ``backend``, ``version``, ``thread_count``...);
    nothing is configured by them here."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _refuse_unsupported(sharded_strategy, s3_region, s3client_config) -> None:
    default = sharded_strategy is None or sharded_strategy is PyTorchDistSaveShardedStrategy \
        or isinstance(sharded_strategy, PyTorchDistSaveShardedStrategy)
    if not default:
        raise NotImplementedError(f"sharded_strategy={type(sharded_strategy).__name__}: only DCP's own file layout "
                                  "(PyTorchDistSaveShardedStrategy, the default) is built")
    if s3_region is not None or s3client_config is not None:
        raise NotImplementedError("s3_region / s3client_config: S3 checkpoints are not built here")


def _extra_files(state_dict) -> dict:
    """The layout record of the local state dicts in ``state_dict`` (checked when loading)."""
    layouts = local_layouts(state_dict)
    return {LOCAL_LAYOUT_FILE: json.dumps(layouts, sort_keys=True).encode()} if layouts else {}


@paused_gc()
def async_save(state_dict, *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
               process_group: dist.ProcessGroup | None = None, coordinator_rank: int = 0,
               queue: AsyncCallsQueue | None = None, sharded_strategy=None, wait_error_handling: bool = True,
               force_check_all_plans: bool = True, s3_region: str | None = None, s3client_config=None) -> None:
    """Save ``state_dict`` to ``checkpoint_id`` in the background: plan (a collective over
    ``process_group``), copy to host memory what a forward may change, return; the queue's
    thread copies the rest (optimizer slots, sharded and local parameters: every optimizer's
    ``step`` waits until it has) and writes; the files are written by the
    queue's writer thread and the checkpoint is complete once ``queue.maybe_finalize_async_calls``
    (or this module's ``maybe_finalize_async_calls`` for the default queue) has finalized it.

    Args:
        state_dict: the (nested) state dict; tensors, DTensors, ShardedTensors and plain data.
        checkpoint_id: the checkpoint directory (or give ``storage_writer``).
        storage_writer: a DCP ``StorageWriter`` (e.g. ``DistributedFileSystemWriter``).
        planner: a DCP ``SavePlanner`` (default: ``DefaultSavePlanner``).
        process_group: the ranks saving this checkpoint together (default: the world); only they
            call this.
        coordinator_rank: the global rank (a member of ``process_group``) that writes the metadata.
        queue: where the save waits to be finalized (default: the job's queue, which needs
            ``init`` first).
        wait_error_handling, force_check_all_plans: accepted; every failure is raised on every
            rank and every plan is checked.

    Raises:
        ValueError: a coordinator outside the group, a rank not in it, no destination.
        RuntimeError: no ``queue`` given and no job started (``init``) to hold the default one.
        NotImplementedError: ``sharded_strategy``, S3 options.
        CheckpointSaveError: planning or staging failed on some rank (raised on all).
    """
    del wait_error_handling, force_check_all_plans
    _refuse_unsupported(sharded_strategy, s3_region, s3client_config)
    group = saving.group_of(process_group, coordinator_rank)
    writer = directory.writer_for(checkpoint_id, storage_writer)
    queue = queue or _default_queue()
    if queue is None:
        raise RuntimeError("async_save without queue= uses the job's queue: call torch.sagemaker.init() "
                           "(modelparallel.init()) first, or pass queue=AsyncCallsQueue()")
    state_dict, _ = stages.qualified(state_dict)  # pipeline stages: their own non-tensor entries
    extra = _extra_files(state_dict)
    directories.save_each(lambda sd, w, g: queue.schedule(sd, w, planner, g, extra), state_dict, writer, group)


@paused_gc()
def save(state_dict, *, checkpoint_id: str | os.PathLike | None = None, storage_writer: StorageWriter | None = None,
         planner: SavePlanner | None = None, process_group: dist.ProcessGroup | None = None,
         coordinator_rank: int = 0, wait_error_handling: bool = True, force_check_all_plans: bool = True,
         s3_region: str | None = None, s3client_config=None) -> None:
    """Save ``state_dict`` synchronously: ``async_save`` on a private queue that copies nothing,
    finalized before returning (the same files, the same checks; in a job the plan cache is the
    job's queue's, so a repeated save reuses its plan). Arguments as ``async_save``'s."""
    queue = AsyncCallsQueue()
    queue.staging = "none"  # finished before returning: the files are written from the tensors themselves
    default = _default_queue()
    if default is not None:
        queue.plans = default.plans  # a repeated save of the same structure reuses its plan
    try:
        async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                   process_group=process_group, coordinator_rank=coordinator_rank, queue=queue,
                   wait_error_handling=wait_error_handling, force_check_all_plans=force_check_all_plans,
                   s3_region=s3_region, s3client_config=s3client_config)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()


def maybe_finalize_async_calls(blocking: bool = True, process_group: dist.ProcessGroup | None = None) -> list[int]:
    """Finalize the job's default queue's saves (see ``AsyncCallsQueue.maybe_finalize_async_calls``);
    none outside a job."""
    queue = _default_queue(create=False)
    return queue.maybe_finalize_async_calls(blocking=blocking, process_group=process_group) if queue else []
