"""Failures of an asynchronous save reach every rank: a background write that fails on one rank
raises ``CheckpointSaveError`` naming that rank on every rank at ``maybe_finalize_async_calls``,
and nothing is left behind (the hidden directory it wrote into is removed). A failure means one rank's error was
lost (the others would carry on, or hang in the next collective) or a broken save looks complete.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

import harness
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.distributed.checkpoint.saving import CheckpointSaveError
from modelparallel.distributed.checkpoint.state_dict_saver import async_save


class FailingWriter(FileSystemWriter):
    """Fails its background write on rank 1, as a full disk would."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


def failing_write(root):
    queue = AsyncCallsQueue()
    where = os.path.join(root, "ckpt")
    state = {f"t{dist.get_rank()}": torch.full((4,), float(dist.get_rank())), "step": 1}
    async_save(state, storage_writer=FailingWriter(where), queue=queue)  # returns: staged
    with pytest.raises(CheckpointSaveError, match=r"(?s)^OSError: .*No space left.*failed on 1 of 2 ranks:\n  "
                                                  r"rank 1: OSError: .*No space left"):
        queue.maybe_finalize_async_calls(blocking=True)
    dist.barrier()
    assert os.listdir(root) == [], "a failed save left files behind"
    assert queue.maybe_finalize_async_calls(blocking=True) == []  # nothing left pending
    queue.close()
    return dist.get_rank()


def test_background_write_failure_raised_on_every_rank(tmp_path):
    harness.run(2, failing_write, str(tmp_path))


def default_strategy_named(root):
    """SageMaker's default ``sharded_strategy`` named by the script saves as without it; any other
    strategy is refused before anything is written."""
    from torch.distributed.checkpoint import FileSystemReader, load

    from modelparallel.distributed.checkpoint.state_dict_saver import PyTorchDistSaveShardedStrategy

    queue = AsyncCallsQueue()
    where = os.path.join(root, "ckpt")
    state = {f"t{dist.get_rank()}": torch.full((4,), float(dist.get_rank() + 1))}
    async_save(state, checkpoint_id=where, queue=queue,
               sharded_strategy=PyTorchDistSaveShardedStrategy("torch_dist", 1, thread_count=2))
    queue.maybe_finalize_async_calls(blocking=True)
    back = {k: torch.zeros(4) for k in state}
    load(back, storage_reader=FileSystemReader(where))
    with pytest.raises(NotImplementedError, match="sharded_strategy=object"):
        async_save(state, checkpoint_id=os.path.join(root, "other"), queue=queue, sharded_strategy=object())
    queue.close()
    assert not os.path.exists(os.path.join(root, "other"))
    return all(torch.equal(back[k], state[k]) for k in state)


def test_default_sharded_strategy_accepted(tmp_path):
    assert harness.run(2, default_strategy_named, str(tmp_path)) == [True, True]
