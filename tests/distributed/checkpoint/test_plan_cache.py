"""Repeated asynchronous saves of the same structure reuse their DCP plan (``saving.PlanCache``)
and still write exactly what ``dcp.load`` reads back; a structure that changed on any one rank
is planned again. A failure means the cache skipped the global planning when a rank's plan had
changed (a stale plan: wrong or missing entries on disk) or never reused a plan (every save
pays the plan gather, global planning and scatter again). 2 ranks, plain tensors.
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import harness
from modelparallel.distributed.checkpoint import planning
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.distributed.checkpoint.state_dict_saver import async_save


def _state(step: int, extra: bool = False) -> dict:
    rank = dist.get_rank()
    state = {f"w{rank}": torch.arange(6.0) * (step + 1) + rank, "shared": torch.full((3,), float(step)), "step": step}
    if extra:
        state[f"extra{rank}"] = torch.ones(2) * step
    return state


def _load(path: str, like: dict) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in like.items()}
    dcp.load(out, checkpoint_id=path)
    return out


def repeated_saves(root: str) -> dict:
    real = planning.global_plan
    planned = []

    def counting(*args, **kwargs):
        planned.append(1)
        return real(*args, **kwargs)

    planning.global_plan = counting
    queue = AsyncCallsQueue()
    checks = []
    try:
        plan = [(0, False), (1, False), (2, dist.get_rank() == 1), (3, dist.get_rank() == 1), (4, False)]
        for step, extra in plan:
            before = len(planned)
            path = os.path.join(root, f"step{step}")
            state = _state(step, extra)
            async_save(state, checkpoint_id=path, queue=queue)
            queue.maybe_finalize_async_calls(blocking=True)
            got = _load(path, state)
            same = all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
                       for k, v in state.items())
            checks.append((step, len(planned) - before, same))
    finally:
        planning.global_plan = real
        queue.close()
    return {"checks": checks, "cached": len(queue.plans.entries)}


def test_a_repeated_structure_reuses_its_plan_and_a_changed_one_is_planned_again(tmp_path):
    for r in harness.run(2, repeated_saves, str(tmp_path)):
        # step 0: first plan; 1: same structure, reused; 2: rank 1 adds an entry, planned on
        # both ranks; 3: reused again; 4: back to the first structure, planned again
        assert r["checks"] == [(0, 1, True), (1, 0, True), (2, 1, True), (3, 0, True), (4, 1, True)], r
        assert r["cached"] == 1, r


def repeated_sync_saves(root: str) -> list:
    import modelparallel as tsm
    from modelparallel.distributed.checkpoint.state_dict_saver import save

    tsm.init({"tensor_parallel_degree": 1})  # the plan cache is the job's
    real = planning.global_plan
    planned = []
    planning.global_plan = lambda *a, **k: planned.append(1) or real(*a, **k)
    out = []
    try:
        for step in range(3):
            before = len(planned)
            path = os.path.join(root, f"sync{step}")
            state = {**_state(step), "marker": "sync-test"}
            save(state, checkpoint_id=path)
            got = _load(path, state)
            same = all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in state.items())
            out.append((len(planned) - before, same))
    finally:
        planning.global_plan = real
    return out


def test_repeated_synchronous_saves_reuse_their_plan(tmp_path):
    """``save`` makes a private queue per call but shares the job's default queue's plan cache:
    the second and third saves of one structure skip the global planning and load back exactly."""
    for r in harness.run(2, repeated_sync_saves, str(tmp_path)):
        assert [same for _, same in r] == [True, True, True], r
        assert [n for n, _ in r][1:] == [0, 0], r


def default_queue_of_the_job(root: str) -> dict:
    import modelparallel as tsm
    from modelparallel import runtime
    from modelparallel.distributed.checkpoint.state_dict_saver import maybe_finalize_async_calls

    tsm.init({"tensor_parallel_degree": 1})
    state = _state(5)
    async_save(state, checkpoint_id=os.path.join(root, "default"))  # names no queue
    held = runtime.current().checkpoint_queue
    finalized = maybe_finalize_async_calls(blocking=True)
    got = _load(os.path.join(root, "default"), state)
    same = all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in state.items())
    tsm.init({"tensor_parallel_degree": 1})  # a new job: a new, empty default queue
    return {"held": held is not None, "finalized": finalized, "same": same,
            "fresh": runtime.current().checkpoint_queue is None and maybe_finalize_async_calls() == []}


def test_the_default_queue_belongs_to_the_job(tmp_path):
    """A save that names no queue goes to the queue the job's runtime holds (made at that save),
    the module's ``maybe_finalize_async_calls`` finalizes it, and the next ``init`` starts
    without one (no queue shared between jobs through module state)."""
    for r in harness.run(2, default_queue_of_the_job, str(tmp_path)):
        assert r == {"held": True, "finalized": [0], "same": True, "fresh": True}, r
