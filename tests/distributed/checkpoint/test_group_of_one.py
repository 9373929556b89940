"""Saves over a process group of one rank (each tensor-parallel rank's FSDP group when there is
no data parallelism): the call's agreement needs no collective there, and must still refuse what
it refuses over a larger group. A failure means a save over a group of one writes what ``dcp.load``
does not read back, reuses no plan, or lets a refused save through (or hangs on it). 2 ranks,
each with its own group and directory.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import harness
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.distributed.checkpoint.outcome import CheckpointSaveError
from modelparallel.distributed.checkpoint.state_dict_saver import async_save


def alone(root: str) -> dict:
    rank = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    mine = groups[rank]
    queue = AsyncCallsQueue()
    out = {"same": []}
    try:
        for step in range(3):
            state = {"w": torch.arange(8.0) * (step + 1) + rank, "step": step}
            path = os.path.join(root, f"r{rank}_s{step}")
            async_save(state, checkpoint_id=path, process_group=mine, coordinator_rank=rank, queue=queue)
            queue.maybe_finalize_async_calls(blocking=True)
            got = {"w": torch.zeros(8), "step": -1}
            dcp.load(got, checkpoint_id=path, process_group=mine)
            out["same"].append(torch.equal(got["w"], state["w"]) and got["step"] == step)
        out["reused"] = queue.plans.hits
        blocker = os.path.join(root, f"file{rank}")
        open(blocker, "w").close()
        with pytest.raises(CheckpointSaveError) as caught:
            async_save({"w": torch.ones(2)}, checkpoint_id=blocker, process_group=mine, coordinator_rank=rank,
                       queue=queue)
        out["refused"] = blocker in str(caught.value) and os.path.isfile(blocker)
    finally:
        queue.close()
    return out


def test_a_group_of_one_saves_reuses_its_plan_and_refuses_as_any_group(tmp_path):
    for r in harness.run(2, alone, str(tmp_path)):
        assert r == {"same": [True, True, True], "reused": 2, "refused": True}, r
