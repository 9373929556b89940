"""The v2 save (``state_dict_saver.save`` / ``async_save``) over an existing checkpoint, on 2
ranks: a save failing on one rank or not yet finalized leaves the previous checkpoint loading as
saved (and a later save removes what a killed one left, nothing else); a local save over ranks
holding other shards is refused before writing; post-write hooks run after the commit; and the
directory is a plain DCP checkpoint that ``dcp.load`` and ``dcp_to_torch_save`` read.

A failure points at ``directory`` (the commit, leftovers), ``state_dict_saver`` (the refusal
before writing) or the writer's hooks. Kept apart from ``test_v2_checkpoint_safety.py`` (hostile
or damaged directories a load must refuse), whose states and comparisons these reuse.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import harness
from modelparallel.checkpoint.safety.errors import CheckpointError
from modelparallel.distributed.checkpoint.state_dict_loader import load
from modelparallel.distributed.checkpoint.state_dict_saver import save
from test_v2_checkpoint_safety import _same, _state, _zeros


class _FailsOnRank1(FileSystemWriter):
    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


def failed_save_keeps_the_old(root):
    path = Path(root) / "ck"
    save(_state(2.0), checkpoint_id=str(path))
    with pytest.raises(CheckpointError, match="No space left on device"):
        save(_state(3.0), storage_writer=_FailsOnRank1(str(path)))
    dist.barrier()
    assert sorted(os.listdir(root)) == ["ck"], f"a failed save left {os.listdir(root)}"
    target = _zeros()
    load(target, checkpoint_id=str(path))
    assert _same(target, _state(2.0)), "the previous checkpoint no longer loads as saved"
    if dist.get_rank() == 0:  # what a save killed mid-way leaves, and a user's own hidden entry
        (Path(root) / ".mp-staging-0123456789ab-ck").mkdir()
        (Path(root) / ".mp-staging-0123456789ab-ck" / "__0_0.distcp").write_bytes(b"half")
        (Path(root) / ".mp-notes").write_text("mine")
    dist.barrier()
    save(_state(3.0), checkpoint_id=str(path))  # a save that succeeds replaces it
    load(target, checkpoint_id=str(path))
    assert _same(target, _state(3.0))
    dist.barrier()
    assert sorted(os.listdir(root)) == [".mp-notes", "ck"], f"leftovers: {os.listdir(root)}"
    return sorted(os.listdir(path))


def unfinished_save_keeps_the_old(root):
    from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
    from modelparallel.distributed.checkpoint.state_dict_saver import async_save

    path, queue = Path(root) / "ck", AsyncCallsQueue()
    save(_state(2.0), checkpoint_id=str(path))
    async_save(_state(3.0), checkpoint_id=str(path), queue=queue)  # written, not finalized yet
    queue.close()  # its files are all written: only the commit is missing
    target = _zeros()
    load(target, checkpoint_id=str(path))
    old = _same(target, _state(2.0))
    queue.maybe_finalize_async_calls(blocking=True)
    load(target, checkpoint_id=str(path))
    return old, _same(target, _state(3.0))


def test_an_unfinished_save_leaves_the_previous_checkpoint_loading(tmp_path):
    """An ``async_save`` over a checkpoint, written but not finalized: the directory still loads
    as the previous checkpoint, and as the new one once finalized."""
    assert harness.run(2, unfinished_save_keeps_the_old, str(tmp_path)) == [(True, True)] * 2


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path):
    """A save failing on one rank leaves the checkpoint it would replace loading as saved and
    nothing beside it; the next save removes what a killed save left, and nothing else."""
    listing = harness.run(2, failed_save_keeps_the_old, str(tmp_path))[0]
    assert listing == [".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint_manifest.json"], listing


def plain_dcp_reads_it(root):
    path = Path(root) / "ck"
    save(_state(2.0), checkpoint_id=str(path))
    target = _zeros()
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)))
    assert _same(target, _state(2.0)), "plain DCP loads other values"
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(path), str(Path(root) / "all.pt"))
        full = torch.load(Path(root) / "all.pt", weights_only=True)
        assert full["step"] == 2 and torch.equal(full["model"]["r0.w5"], _state(2.0)["model"]["r0.w5"])
    dist.barrier()
    return dist.get_rank()


def test_the_checkpoint_is_a_plain_dcp_checkpoint(tmp_path):
    """``torch.distributed.checkpoint.load`` with ``FileSystemReader`` and ``dcp_to_torch_save``
    read what the v2 save wrote."""
    harness.run(2, plain_dcp_reads_it, str(tmp_path))


def local_save_over_the_world(root):
    import modelparallel as tsm
    from modelparallel.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type
    from v2_script import build

    tsm.init({"tensor_parallel_degree": 1})  # FSDP shards over both ranks: each holds other tensors
    model, optimizer = build()
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {"model": model.state_dict(), "step": 1}
    with pytest.raises(CheckpointError) as info:
        save(state_dict, checkpoint_id=os.path.join(root, "ck"))  # the world group, one directory
    dist.barrier()
    assert not os.listdir(root), f"a refused save wrote {os.listdir(root)}"
    with pytest.raises(CheckpointError, match=r"local \(SM_LOCAL_STATE_DICT\) load of 'model' over the process "
                                              r"group \[0, 1\]: ranks \[1\] hold other shards than rank 0"):
        load(state_dict, checkpoint_id=os.path.join(root, "ck"))
    return str(info.value).splitlines()[0]


def test_a_local_save_over_ranks_holding_other_shards_is_refused(tmp_path):
    """Over the world group both ranks' flat shards have the same keys and shapes: DCP would
    keep one rank's, and each rank would load rank 0's shard. Refused before writing (and a
    load over such a group before reading)."""
    firsts = harness.run(2, local_save_over_the_world, str(tmp_path))
    assert firsts[0] == firsts[1], f"the ranks raised different errors: {firsts}"
    assert "over the process group [0, 1]: ranks [1] hold other shards than rank 0" in firsts[0], firsts[0]


def hooks_see_the_committed_checkpoint(root):
    from modelparallel.distributed.checkpoint.filesystem import DistributedFileSystemWriter

    path, seen = Path(root) / "ck", []
    hook = lambda w: seen.append((str(w.path), sorted(os.listdir(w.path))))  # noqa: E731
    save(_state(2.0), storage_writer=DistributedFileSystemWriter(str(path), post_write_hooks=[hook]))
    return seen


def test_post_write_hooks_run_after_the_commit(tmp_path):
    """``DistributedFileSystemWriter``'s post-write hooks (e.g. a copy elsewhere) run on every
    rank once, on the committed directory, never on the hidden one being written."""
    want = [(str(tmp_path / "ck"), [".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint_manifest.json"])]
    assert harness.run(2, hooks_see_the_committed_checkpoint, str(tmp_path)) == [want, want]
