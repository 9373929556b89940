"""A reused save plan is chosen by a fingerprint of the structure and checked exactly before
writing (``planning.fingerprint``, ``Entry.verify``).

Each change below is made on rank 1 only, between two saves of an otherwise equal state dict:
every rank must plan again (one global planning per save) and the checkpoint must load back
exactly with ``dcp.load``. A failure means a change the fingerprint missed: the stale plan would
fail that save at its check (or, without the check, write the wrong entries). Then, with the
fingerprint blinded (the same value for any structure), a changed structure must fail its save on
every rank at finalize, naming the entry, leave the checkpoint it would replace intact, and let the
next save plan again. 2 ranks.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import harness
from modelparallel.distributed.checkpoint import planning
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.distributed.checkpoint.state_dict_saver import async_save


def _base(step: int) -> dict:
    """Each rank's own entries (a change on one rank must not make ranks save one key two ways)
    and a shared plain value."""
    r = dist.get_rank()
    return {f"w{r}": torch.arange(6.0) + step + r, f"inner{r}": {"b": torch.ones(3) * step}, "step": step}


def _changed(kind: str, state: dict) -> dict:
    """``state`` with one structural change of ``kind``, made on rank 1 only."""
    if dist.get_rank() != 1:
        return state
    state = dict(state)
    if kind == "dtype":
        state["w1"] = state["w1"].double()
    elif kind == "shape":
        state["w1"] = torch.arange(8.0)
    elif kind == "nesting":  # the same flattened keys in the same order, "inner1.b" from a flat dict
        state = {("inner1.b" if k == "inner1" else k): (v["b"] if k == "inner1" else v) for k, v in state.items()}
    elif kind == "object":
        state["w1"] = [1, 2, 3]
    elif kind == "requires_grad":
        state["w1"] = state["w1"].clone().requires_grad_(True)
    return state


def _load(path: str, like: dict) -> dict:
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else
               {kk: torch.zeros_like(vv) for kk, vv in v.items()} if isinstance(v, dict) else None)
           for k, v in like.items()}
    dcp.load(out, checkpoint_id=path)
    return out


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want.detach())
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], v) for k, v in want.items())
    return got == want


def _counting() -> tuple[list, object]:
    real, planned = planning.global_plan, []
    planning.global_plan = lambda *a, **k: planned.append(1) or real(*a, **k)
    return planned, real


def changes_are_planned_again(root: str, kinds: list) -> list:
    planned, real = _counting()
    queue = AsyncCallsQueue()
    out = []
    try:
        for i, kind in enumerate(kinds):
            for j, state in enumerate((_base(i), _changed(kind, _base(i)), _base(i))):
                path = os.path.join(root, f"{kind}{j}")
                before = len(planned)
                async_save(state, checkpoint_id=path, queue=queue)
                queue.maybe_finalize_async_calls(blocking=True)
                out.append((kind, j, len(planned) - before, _same(_load(path, state), state)))
    finally:
        planning.global_plan = real
        queue.close()
    return out


def test_a_structural_change_on_one_rank_is_planned_again_on_every_rank(tmp_path):
    kinds = ["dtype", "shape", "nesting", "object", "requires_grad"]
    for r in harness.run(2, changes_are_planned_again, str(tmp_path), kinds):
        # per kind: the first save of the base structure plans unless the previous kind's last
        # save left it cached (then 0); the changed one and the return to the base plan again
        expected = [(k, j, n, True) for i, k in enumerate(kinds) for j, n in enumerate((1 if i == 0 else 0, 1, 1))]
        assert r == expected, r


def blinded_fingerprint(root: str) -> dict:
    from modelparallel.distributed.checkpoint.outcome import CheckpointSaveError

    real_fingerprint = planning.fingerprint
    planning.fingerprint = lambda planner: ("blind",)
    queue = AsyncCallsQueue()
    path = os.path.join(root, "ckpt")
    out = {}
    try:
        first = _base(0)
        async_save(first, checkpoint_id=path, queue=queue)
        queue.maybe_finalize_async_calls(blocking=True)
        grown = {**_base(1), **({"extra": torch.ones(2)} if dist.get_rank() == 1 else {})}
        async_save(grown, checkpoint_id=path, queue=queue)  # taken for the first structure
        with pytest.raises(CheckpointSaveError) as caught:
            queue.maybe_finalize_async_calls(blocking=True)
        out["error"] = str(caught.value)
        out["kept"] = _same(_load(path, first), first)
        out["cached_after_failure"] = len(queue.plans.entries)
        async_save(grown, checkpoint_id=path, queue=queue)  # planned again: commits
        queue.maybe_finalize_async_calls(blocking=True)
        out["then"] = _same(_load(path, grown), grown)
    finally:
        planning.fingerprint = real_fingerprint
        queue.close()
    return out


def test_a_plan_reused_by_mistake_fails_its_save_on_every_rank_and_is_dropped(tmp_path):
    for r in harness.run(2, blinded_fingerprint, str(tmp_path)):
        assert "'extra'" in r["error"] and "nothing was committed" in r["error"], r["error"]
        assert "rank 1" in r["error"], r["error"]
        assert r["kept"] and r["cached_after_failure"] == 0 and r["then"], r


def planner_set_up_as_dcp() -> list:
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    torch.manual_seed(0)
    # the last layer's one-element tensors leave rank 1 a ShardedTensor with no local shard (dropped by DCP)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 1), torch.nn.Linear(1, 1, bias=False)),
                 device_id=torch.device("cpu"))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = {"model": model.state_dict()}  # ShardedTensors
    mixed = {"a": {"b": torch.ones(2), "c": [torch.zeros(1), {"d": 3}], "e": (torch.ones(1), 2)}, "f": [1, 2],
             "g": {}, "h": "text", "i": [[torch.ones(3)]]}
    out = []
    for state in (mixed, sharded):
        ours, dcp_own = planning.Planner(), DefaultSavePlanner()
        ours.set_up_planner(state, is_coordinator=True)
        dcp_own.set_up_planner(state, is_coordinator=True)
        out.append((list(ours.state_dict) == list(dcp_own.state_dict),
                    all(ours.state_dict[k] is v for k, v in dcp_own.state_dict.items()),
                    ours.mappings == dcp_own.mappings,
                    ours.create_local_plan() == dcp_own.create_local_plan()))
    return out


def test_the_planner_flattens_as_dcp_s_default_planner():
    """``planning.Planner`` skips DCP's second walk only where it changes nothing: the same keys
    in the same order, the same objects, the same mappings and local plan as DCP's own planner,
    for nested lists, tuples and empty dicts, and for FSDP's ShardedTensors."""
    for r in harness.run(2, planner_set_up_as_dcp):
        assert r == [(True, True, True, True)] * 2, r
