"""DTensors saved with a process group that holds part of their mesh (``group_blocks``), through
PyTorch's own ``dcp.save`` / ``dcp.load`` as SageMaker v2 scripts call them.

A failure of the round trip means a group's block was described with the wrong shape or offset
(DCP then refuses the plan, or loads another rank's data); of the refusal test, that a layout whose
group holds no single block was saved anyway (it would load scrambled).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import harness
from modelparallel.distributed.checkpoint import group_blocks


def round_trip(root):
    group_blocks.install()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(24.0).reshape(6, 4)  # rows split 3 / 3 over tp
    weight = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    norm = distribute_tensor(torch.arange(4.0), mesh, [Shard(0), Replicate()])
    tp = mesh.get_local_rank("tp")
    where = os.path.join(root, f"tp{tp}")
    dp_group = mesh.get_group("dp")
    dcp.save({"w": weight, "n": norm, "step": 7}, checkpoint_id=where, process_group=dp_group)
    saved = dcp.FileSystemReader(where).read_metadata().state_dict_metadata
    assert tuple(saved["w"].size) == (3, 4) and tuple(saved["n"].size) == (4,)
    target = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Replicate(), Shard(0)]),
              "n": distribute_tensor(torch.zeros(4), mesh, [Shard(0), Replicate()]), "step": 0}
    dcp.load(target, checkpoint_id=where, process_group=dp_group)
    assert torch.equal(target["w"].full_tensor(), full) and torch.equal(target["n"].full_tensor(), torch.arange(4.0))
    assert target["step"] == 7

    scrambled = distribute_tensor(full, mesh, [Shard(0), Shard(0)])  # dp splits before tp: no block
    with pytest.raises(NotImplementedError, match="no single block"):
        dcp.save({"w": scrambled}, checkpoint_id=os.path.join(root, f"bad{tp}"), process_group=dp_group)
    return dist.get_rank()


def test_block_per_tp_rank_round_trip_and_refusal(tmp_path):
    harness.run(4, round_trip, str(tmp_path))
