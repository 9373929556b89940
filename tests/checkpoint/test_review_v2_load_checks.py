"""Ordinary mistakes a v2 load (``state_dict_loader.load``) must refuse rather than "succeed"
at, on 2 ranks: loading into tensors still on the meta device (a delayed-init model not yet
materialized: a load into them changes nothing, and reported success) or into an expanded view
(a bare RuntimeError after other tensors were already loaded), and a local
(``SM_LOCAL_STATE_DICT``) checkpoint directory saved by another shard (a directory name computed
from the wrong rank: every shard has the same keys and shapes, so it loaded the other shard's
values silently), and a checkpoint of ours whose manifest was removed (it loaded as a plain DCP
directory, with no checksum: a flipped byte loaded silently). Each must raise on both ranks,
naming the key or file, before anything changes; a directory plain DCP wrote still loads.

A failure points at ``state_dict_loader._problems`` (the meta check) or ``_layout_problems``
with ``state_dict_utils._shard_of`` (the shard recorded in ``.sm_local_layout.json``), or
``directory.check_manifest_kept`` / ``directory.marked`` (the mark in ``.metadata``).
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


def unwritable_target(root: str, kind: str) -> tuple[str, bool]:
    """A state dict whose ``w`` a load cannot write (on the meta device, or an expanded view);
    its other tensors must stay as they were."""
    path = os.path.join(root, "ck")
    save({"a": torch.full((3,), 2.0), "w": torch.arange(6.0), "b": torch.full((3,), 2.0)}, checkpoint_id=path)
    w = torch.empty(6, device="meta") if kind == "meta" else torch.zeros(1).expand(6)
    target = {"a": torch.zeros(3), "w": w, "b": torch.zeros(3)}
    with pytest.raises(CheckpointError) as info:
        load(target, checkpoint_id=path)
    return str(info.value).splitlines()[0], bool((target["a"] == 0).all() and (target["b"] == 0).all())


@pytest.mark.parametrize("kind,says", [("meta", "a tensor on the meta device, which a load cannot change"),
                                       ("expanded", r"an expanded view \(stride 0 along a dimension of size > 1\)")])
def test_a_load_into_tensors_it_cannot_write_is_refused_naming_the_key(tmp_path, kind, says):
    """On the meta device the load changed nothing and reported success; into an expanded view it
    raised a bare RuntimeError after ``a`` was already loaded (not all or nothing)."""
    for first, unchanged in harness.run(2, unwritable_target, str(tmp_path), kind):
        assert re.search(rf"ck: w: {says}", first), first
        assert unchanged, "a refused load changed the state dict"


def other_shards_directory(root: str, wrapper: str) -> tuple[str, bool]:
    """FSDP (``wrapper``: FSDP1 or FSDP2's ``fully_shard``) over both ranks (tensor parallel
    degree 1): each rank saves its local shard into its own directory over its replication group
    (itself), then loads the other rank's."""
    import modelparallel as tsm
    from modelparallel.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type
    from test_v2_fsdp2_local import build as build_fsdp2
    from v2_script import build, replication_group

    tsm.init({"tensor_parallel_degree": 1})
    model, _ = build() if wrapper == "fsdp1" else build_fsdp2(0)
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


@pytest.mark.parametrize("wrapper", ["fsdp1", "fsdp2"])
def test_a_local_directory_of_another_shard_is_refused(tmp_path, wrapper):
    """Both ranks' shards have the same keys and shapes: only the recorded shard tells them apart."""
    for rank, (first, unchanged) in enumerate(harness.run(2, other_shards_directory, str(tmp_path), wrapper)):
        want = (rf"fsdp{1 - rank}: model: this directory holds the local shard with expert_parallel_rank 0, "
                rf"fsdp_shard_rank {1 - rank}, tensor_parallel_rank 0, rank {rank} holds the one with "
                rf"expert_parallel_rank 0, fsdp_shard_rank {rank}, ")
        assert re.search(want, first), first
        assert unchanged, "a refused load changed the model"


def _flip_in_tensor(path: Path, fqn: str) -> None:
    """Flip one bit inside ``fqn``'s stored values (found through the zip record of its chunk)."""
    import io
    import pickle
    import zipfile

    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, trusted by the test
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    data = bytearray((path / info.relative_path).read_bytes())
    chunk = zipfile.ZipFile(io.BytesIO(bytes(data[info.offset:info.offset + info.length])))
    record = next(z for z in chunk.infolist() if "/data/" in z.filename)
    name_len, extra_len = int.from_bytes(data[info.offset + record.header_offset + 26:][:2], "little"), \
        int.from_bytes(data[info.offset + record.header_offset + 28:][:2], "little")
    data[info.offset + record.header_offset + 30 + name_len + extra_len + 5] ^= 0x40
    (path / info.relative_path).write_bytes(bytes(data))


def manifest_removed(root: str) -> tuple[str, bool, bool]:
    import torch.distributed.checkpoint as dcp

    path, plain = Path(root) / "ck", Path(root) / "plain"
    state = {"w": torch.arange(64.0).reshape(8, 8), f"r{dist.get_rank()}": torch.full((4,), 3.0)}
    save(state, checkpoint_id=str(path))
    dcp.save(state, checkpoint_id=str(plain))  # PyTorch's own save: no manifest, no mark
    if dist.get_rank() == 0:
        os.remove(path / "checkpoint_manifest.json")
        _flip_in_tensor(path, "w")
    dist.barrier()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CheckpointError) as info:
        load(target, checkpoint_id=str(path))
    unchanged = all(bool((v == 0).all()) for v in target.values())
    load(target, checkpoint_id=str(plain))
    return str(info.value).splitlines()[0], unchanged, all(torch.equal(target[k], state[k]) for k in state)


def test_a_checkpoint_of_ours_without_its_manifest_is_refused(tmp_path):
    for first, unchanged, plain in harness.run(2, manifest_removed, str(tmp_path)):
        assert re.search(r"ck/checkpoint_manifest\.json: missing, but this checkpoint was saved by modelparallel", first), \
            first
        assert unchanged, "a refused load changed the state dict"
        assert plain, "a directory PyTorch's DCP wrote no longer loads as saved"
