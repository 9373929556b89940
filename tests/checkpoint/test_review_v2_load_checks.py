"""Ordinary mistakes a v2 load (``state_dict_loader.load``) must refuse rather than "succeed"
at, on 2 ranks: loading into tensors still on the meta device (a delayed-init model not yet
materialized: a load into them changes nothing, and reported success), and a local
(``SM_LOCAL_STATE_DICT``) checkpoint directory saved by another shard (a directory name computed
from the wrong rank: every shard has the same keys and shapes, so it loaded the other shard's
values silently). Each must raise on both ranks, naming the key, before anything changes.

A failure points at ``state_dict_loader._problems`` (the meta check) or ``_layout_problems``
with ``state_dict_utils._shard_of`` (the shard recorded in ``.sm_local_layout.json``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import harness
from modelparallel.checkpoint.safety.errors import CheckpointError
from modelparallel.distributed.checkpoint.state_dict_loader import load
from modelparallel.distributed.checkpoint.state_dict_saver import save

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "checkpoint"))


def meta_target(root: str) -> tuple[str, bool]:
    """A state dict whose ``w`` is on the meta device; its other tensor must stay as it was."""
    path = os.path.join(root, "ck")
    save({"w": torch.arange(6.0), "b": torch.full((3,), 2.0)}, checkpoint_id=path)
    target = {"w": torch.empty(6, device="meta"), "b": torch.zeros(3)}
    with pytest.raises(CheckpointError) as info:
        load(target, checkpoint_id=path)
    return str(info.value).splitlines()[0], bool((target["b"] == 0).all())


def test_a_load_into_meta_tensors_is_refused_naming_the_key(tmp_path):
    for first, unchanged in harness.run(2, meta_target, str(tmp_path)):
        assert re.search(r"ck: w: a tensor on the meta device, which a load cannot change", first), first
        assert unchanged, "a refused load changed the state dict"


def other_shards_directory(root: str) -> tuple[str, bool]:
    """FSDP over both ranks (tensor parallel degree 1): each rank saves its local shard into its
    own directory over its replication group (itself), then loads the other rank's."""
    import modelparallel as tsm
    from modelparallel.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type
    from v2_script import build, replication_group

    tsm.init({"tensor_parallel_degree": 1})
    model, _ = build()
    group, coordinator = replication_group()
    rank = dist.get_rank()
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {"model": model.state_dict()}
        before = {k: v.clone() for k, v in state_dict["model"].items()}
        save(state_dict, checkpoint_id=os.path.join(root, f"fsdp{rank}"), process_group=group,
             coordinator_rank=coordinator)
        dist.barrier()
        load(state_dict, checkpoint_id=os.path.join(root, f"fsdp{rank}"), process_group=group,
             coordinator_rank=coordinator)  # its own directory loads
        with pytest.raises(CheckpointError) as info:
            load(state_dict, checkpoint_id=os.path.join(root, f"fsdp{1 - rank}"), process_group=group,
                 coordinator_rank=coordinator)
        unchanged = all(torch.equal(before[k], v) for k, v in state_dict["model"].items())
    dist.barrier()
    return str(info.value).splitlines()[0], unchanged


def test_a_local_directory_of_another_shard_is_refused(tmp_path):
    """Both ranks' flat shards have the same keys and shapes: only the recorded shard tells them
    apart."""
    for rank, (first, unchanged) in enumerate(harness.run(2, other_shards_directory, str(tmp_path))):
        want = (rf"fsdp{1 - rank}: model: this directory holds the local shard with expert_parallel_rank 0, "
                rf"fsdp_shard_rank {1 - rank}, tensor_parallel_rank 0, rank {rank} holds the one with "
                rf"expert_parallel_rank 0, fsdp_shard_rank {rank}, ")
        assert re.search(want, first), first
        assert unchanged, "a refused load changed the model"
