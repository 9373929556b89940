"""Ordinary mistakes a v2 save (``state_dict_saver.save`` / ``async_save``) must refuse before
it writes, on 2 ranks: ranks passing different ``coordinator_rank`` values (each gathered the
plans itself: both ranks hung until the collective timeout), and a save of a path that another
queue still has an asynchronous save of pending (its staging directory was taken for a
leftover and deleted, and its finalize failed later with a ``FileNotFoundError`` in a hidden
directory). Each must raise the same error on both ranks naming the checkpoint, leave the disk
as it was, and leave the pending save to commit as it would have.

A failure points at ``saving._prepare`` (the coordinators' agreement, the pending paths),
``AsyncCallsQueue.schedule`` (which paths other queues hold) or
``state_dict_utils.check_plans_agree`` (called by ``planning.global_plan``).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

import harness
from modelparallel.checkpoint.safety.errors import CheckpointError
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.distributed.checkpoint.state_dict_loader import load
from modelparallel.distributed.checkpoint.state_dict_saver import async_save, save


def _state(value: float) -> dict:
    return {"w": torch.full((4, 4), value), f"r{dist.get_rank()}": torch.full((3,), value), "step": int(value)}


def _loaded(path: str) -> dict:
    target = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in _state(0.0).items()}
    load(target, checkpoint_id=path)
    return target


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def coordinators_differ(root: str) -> tuple[str, list, bool]:
    path = os.path.join(root, "ck")
    save(_state(1.0), checkpoint_id=path)
    with pytest.raises(CheckpointError) as info:
        save(_state(2.0), checkpoint_id=path, coordinator_rank=dist.get_rank())
    dist.barrier()
    return str(info.value).splitlines()[0], sorted(os.listdir(root)), _equal(_loaded(path), _state(1.0))


def test_ranks_naming_different_coordinators_are_refused_not_hung(tmp_path):
    firsts = harness.run(2, coordinators_differ, str(tmp_path))
    assert firsts[0] == firsts[1], f"the ranks raised different errors: {firsts}"
    first, listing, old = firsts[0]
    assert re.search(r"ck: the ranks name different coordinators \(global rank -> coordinator_rank: \{0: 0, 1: 1\}\)",
                     first), first
    assert listing == ["ck"] and old, f"a refused save changed the disk: {listing}, previous loads: {old}"


def save_over_a_pending_save(root: str) -> tuple[str, bool, bool, list]:
    path, queue = os.path.join(root, "ck"), AsyncCallsQueue()
    save(_state(1.0), checkpoint_id=path)
    async_save(_state(2.0), checkpoint_id=path, queue=queue)
    with pytest.raises(CheckpointError) as info:
        save(_state(3.0), checkpoint_id=path)  # its own queue: the pending one is another's
    old = _equal(_loaded(path), _state(1.0))
    queue.maybe_finalize_async_calls(blocking=True)
    dist.barrier()
    return str(info.value).splitlines()[0], old, _equal(_loaded(path), _state(2.0)), sorted(os.listdir(root))


def test_a_save_over_a_path_another_queue_has_pending_is_refused(tmp_path):
    results = harness.run(2, save_over_a_pending_save, str(tmp_path))
    assert results[0] == results[1], f"the ranks differ: {results}"
    first, old, committed, listing = results[0]
    assert re.search(r"ck: an asynchronous save of it is still pending in another queue", first), first
    assert old, "the refused save changed the checkpoint"
    assert committed and listing == ["ck"], f"the pending save did not commit as saved: {committed}, {listing}"


def shapes_differ(root: str) -> tuple[str, list]:
    rank = dist.get_rank()
    with pytest.raises(CheckpointError) as info:
        save({"w": torch.full((4 + rank,), float(rank)), "b": torch.ones(2)}, checkpoint_id=os.path.join(root, "ck"))
    dist.barrier()
    return str(info.value).splitlines()[0], sorted(os.listdir(root))


def test_a_key_whose_shape_differs_between_ranks_is_refused(tmp_path):
    results = harness.run(2, shapes_differ, str(tmp_path))
    assert results[0] == results[1], f"the ranks differ: {results}"
    first, listing = results[0]
    assert re.search(r"state dict entry 'w' differs between the ranks saving it \(ranks \[0\]: \(4,\) torch\.float32; "
                     r"ranks \[1\]: \(5,\) torch\.float32\)", first), first
    assert listing == [], f"a refused save wrote {listing}"
