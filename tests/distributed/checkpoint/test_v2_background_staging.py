"""Background staging of SageMaker v2's ``async_save``: what only an optimizer step changes
(optimizer slots, sharded and local parameters) is copied by the queue's writer thread, every
optimizer's next ``step`` waits for that copy, and anything else changed in place before its
copy fails the save on every rank.

Training goes on right after the call while staging is held (the stager's ``before_copy`` hook,
released only once the optimizer step has started), so the order of events is fixed, not left
to timing. The checkpoint must
hold exactly the state of the call (compared with a copy taken then, tensor by tensor, after
loading it into a freshly built model). A failure means modelparallel/distributed/checkpoint
(``staging.deferrable``, ``staging.stage``, ``saving.start``) or checkpoint/background/async_save.py
(``hold_every_optimizer``, ``copy_deferred``) let a step reach the checkpoint, let a step run
before staging ended, or let a torn copy be finalized. 2 ranks, FSDP1 over both (v2 scripts' model).
"""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.optim.optimizer as optimizer_module
from torch.optim.optimizer import register_optimizer_step_pre_hook

import harness
import modelparallel as tsm
from modelparallel.checkpoint.background.deferred import Early
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.distributed.checkpoint.saving import CheckpointSaveError
from modelparallel.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type
from v2_script import build, load_local, load_sharded, replication_group, save_local, save_sharded, train_step
from state_helpers import recording_defers


def local_state(model, optimizer) -> dict:
    """Copies of this rank's model and optimizer tensors (what a local checkpoint holds)."""
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, slots in enumerate(optimizer.state.values()):
        out.update({f"optimizer.{i}.{k}": v.clone() for k, v in slots.items() if torch.is_tensor(v)})
    return out


def differences(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def save(kind, model, optimizer, root, queue):
    if kind == "local":
        save_local(model, optimizer, root, {"total_steps": 2}, replication_group(), queue)
    else:
        save_sharded(model, optimizer, root, {"total_steps": 2}, queue)


def load(kind, root):
    fresh, fresh_opt = build(seed=1)
    if kind == "local":
        load_local(fresh, fresh_opt, root, {"total_steps": 0}, replication_group())
    else:
        load_sharded(fresh, fresh_opt, root, {"total_steps": 0})
    return fresh, fresh_opt


def steps_during_staging(kind: str, root: str) -> dict:
    tsm.init({"tensor_parallel_degree": 1})
    model, optimizer = build()
    for s in range(2):
        train_step(model, optimizer, s)
    queue = AsyncCallsQueue()
    release = threading.Event()
    queue.saver.stager.before_copy = lambda: (release.wait(), time.sleep(0.2))  # a copy that takes a while
    entry, seen = [], []

    def at_entry(*_):  # runs before the save's own hook: staging is still paused here, then released
        entry.append(queue.saver.job.staged.is_set())
        release.set()

    first = register_optimizer_step_pre_hook(at_entry)
    save(kind, model, optimizer, root, queue)
    want = local_state(model, optimizer)
    job, stager = queue.saver.job, queue.saver.stager
    deferred, copied = stager.deferred_bytes, stager.copied_bytes
    late = optimizer.register_step_pre_hook(lambda *_: seen.append(job.staged.is_set()))  # after every global hook
    safety = threading.Timer(60, release.set)  # never needed unless the step is never reached
    safety.start()
    train_step(model, optimizer, 2)  # forward, backward, clipping: then the step waits
    safety.cancel()
    first.remove()
    late.remove()
    queue.maybe_finalize_async_calls(blocking=True)
    hooks_left = len(optimizer_module._global_optimizer_pre_hooks)
    fresh, fresh_opt = load(kind, root)
    return {"deferred": deferred, "copied": copied, "entry": entry, "seen": seen, "held": job.held_s,
            "hooks_left": hooks_left,
            "diff": differences(want, local_state(fresh, fresh_opt)),
            "moved": differences(want, local_state(model, optimizer))}


@pytest.mark.parametrize("kind", ["local", "sharded"])
def test_training_right_after_async_save_waits_and_the_checkpoint_holds_the_call(kind, tmp_path):
    for r in harness.run(2, steps_during_staging, kind, str(tmp_path)):
        assert r["deferred"] > 10 * r["copied"], f"the parameters and slots were not left to the background: {r}"
        assert r["entry"] == [False], "staging was done before the step even started: the test proves nothing"
        assert r["seen"] == [True], "the optimizer step ran before staging was done"
        assert r["held"] > 0.1, f"the step's wait was not counted: {r['held']} (the copy takes >= 0.2 s)"
        assert r["moved"], "the step after the save changed nothing: the test would prove nothing"
        assert r["diff"] == [], f"the checkpoint is not the state of the call: {r['diff'][:5]}"
        assert r["hooks_left"] == 0, "the global step hook is removed once the save is done"


def change_during_staging(root: str) -> dict:
    """A parameter changed in place outside the optimizer (through FSDP's original parameter,
    an alias of the flat parameter saved) while staging is held: the save fails, naming the flat
    parameter, and nothing is left (its hidden directory is removed). Each rank saves its own
    shard's directory here (FSDP over both ranks: one-rank replication groups)."""
    tsm.init({"tensor_parallel_degree": 1})
    model, optimizer = build()
    train_step(model, optimizer, 0)
    queue = AsyncCallsQueue()
    release = threading.Event()
    queue.saver.stager.before_copy = release.wait
    save("local", model, optimizer, root, queue)
    with torch.no_grad():
        next(model.parameters()).mul_(2.0)
    release.set()
    with pytest.raises(CheckpointSaveError) as error:
        queue.maybe_finalize_async_calls(blocking=True)
    dist.barrier()
    return {"msg": str(error.value), "left": sorted(os.listdir(root))}


def test_an_in_place_change_before_staging_fails_the_save_on_every_rank(tmp_path):
    results = harness.run(2, change_during_staging, str(tmp_path))
    for r in results:
        assert "changed in place after async_save returned" in r["msg"] and "model._flat_param" in r["msg"], r["msg"]
        assert "background_staging=False" in r["msg"], r["msg"]
        assert r["left"] == [], f"a failed save left {r['left']}"


def _edits(model, optimizer) -> dict:
    """In-place changes that bypass every version counter: through ``.data`` and numpy, on an
    original parameter (FSDP's view into the flat parameter saved) and on an optimizer slot."""
    p = max(model.parameters(), key=lambda q: q.numel())  # large enough for write tracking's pages
    slot = optimizer.state[p]["exp_avg"]
    return {"param.data.clamp_": lambda: p.data.clamp_(-1e-4, 1e-4),
            "param numpy view": lambda: p.detach().numpy().__imul__(3.0),
            "exp_avg.data.zero_": lambda: slot.data.zero_()}


def edits_bypassing_version_counters(root: str, way: str) -> dict:
    """Each edit made right after ``async_save`` returned, staging held: the save fails on every
    rank. ``way``: ``"pages"``, the tensors' pages write-protected by the call (the kernel's write
    tracking, ``background/pages.py``; its size floor lowered to this model's shards); ``"early"``,
    their CRC32s read by threads while the call plans (``Early``, used where a rank has a core to
    spare, forced here); ``"read"``, by the call as it stages."""
    tsm.init({"tensor_parallel_degree": 1})
    model, optimizer = build()
    train_step(model, optimizer, 0)
    queue, out, taken, watched = AsyncCallsQueue(), {}, [], set()
    stager = queue.saver.stager
    stager.defer = recording_defers(stager, watched)
    if way == "pages":
        stager.pages.min_bytes = stager.pages.min_save_bytes = 0
    else:
        stager.pages = None
    pays, take = Early.pays, Early.take
    Early.pays = classmethod(lambda cls: way == "early")
    Early.take = lambda self, t: taken.append(1) or take(self, t)
    try:
        for what, edit in _edits(model, optimizer).items():
            release = threading.Event()
            queue.saver.stager.before_copy = release.wait
            save("local", model, optimizer, root, queue)
            edit()
            release.set()
            with pytest.raises(CheckpointSaveError) as error:
                queue.maybe_finalize_async_calls(blocking=True)
            out[what] = str(error.value)
    finally:
        Early.pays, Early.take = pays, take
    dist.barrier()
    return {**out, "taken": len(taken), "watched": sorted(watched), "left": sorted(os.listdir(root))}


@pytest.mark.parametrize("way", ["read", "early", "pages"])
def test_changes_through_data_and_numpy_fail_the_save(tmp_path, way):
    for r in harness.run(2, edits_bypassing_version_counters, str(tmp_path), way):
        for what in ("param.data.clamp_", "param numpy view", "exp_avg.data.zero_"):
            assert "changed in place after async_save returned" in r[what], (what, r[what])
        assert (r["taken"] > 0) == (way == "early"), r["taken"]
        named = [r[what].split("returned and before they were staged: ")[1].split(". ")[0] for what in r
                 if what.startswith(("param", "exp_avg"))]
        if way == "pages":  # the edited tensors were watched by their pages, not read
            assert all(name in r["watched"] for names in named for name in names.split(", ")), (named, r["watched"])
        else:
            assert r["watched"] == [], r["watched"]
        assert r["left"] == [], f"a failed save left {r['left']}"


def staging_in_the_call(root: str) -> dict:
    """``AsyncCallsQueue(background_staging=False)``: everything is copied in the call, no step
    waits, and an in-place change right after the call does not reach the checkpoint."""
    tsm.init({"tensor_parallel_degree": 1})
    model, optimizer = build()
    train_step(model, optimizer, 0)
    queue = AsyncCallsQueue(background_staging=False)
    queue.saver.stager.before_copy = lambda: (_ for _ in ()).throw(AssertionError("a background copy ran"))
    save("local", model, optimizer, root, queue)
    want = local_state(model, optimizer)
    deferred, hooks = queue.saver.stager.deferred_bytes, len(queue.saver.job.hooks)
    with torch.no_grad():
        next(model.parameters()).mul_(2.0)
    train_step(model, optimizer, 1)
    queue.maybe_finalize_async_calls(blocking=True)
    fresh, fresh_opt = load("local", root)
    return {"deferred": deferred, "hooks": hooks, "diff": differences(want, local_state(fresh, fresh_opt))}


def test_staging_in_the_call_when_asked(tmp_path):
    for r in harness.run(2, staging_in_the_call, str(tmp_path)):
        assert r == {"deferred": 0, "hooks": 0, "diff": []}, r


def load_during_staging(root: str) -> dict:
    """A v2 ``load`` into the live model right after an async save waits for the save's
    background copy (released 0.3 s later): the save holds the state of its call, and the load
    then takes effect."""
    tsm.init({"tensor_parallel_degree": 1})
    model, optimizer = build()
    train_step(model, optimizer, 0)
    first = os.path.join(root, "first")
    save("local", model, optimizer, first, None)  # a synchronous save to load back later
    train_step(model, optimizer, 1)
    queue = AsyncCallsQueue()
    release = threading.Event()
    queue.saver.stager.before_copy = release.wait
    second = os.path.join(root, "second")
    save("local", model, optimizer, second, queue)
    want = local_state(model, optimizer)
    threading.Timer(0.3, release.set).start()
    load_local(model, optimizer, first, {"total_steps": 0}, replication_group())
    loaded = local_state(model, optimizer)
    queue.maybe_finalize_async_calls(blocking=True)
    fresh, fresh_opt = load("local", second)
    return {"diff": differences(want, local_state(fresh, fresh_opt)), "load_changed": bool(differences(want, loaded))}


def test_a_load_right_after_an_async_save_waits_for_its_copy(tmp_path):
    for r in harness.run(2, load_during_staging, str(tmp_path)):
        assert r == {"diff": [], "load_changed": True}, r


def sync_save_copies_nothing(root: str) -> int:
    """``save`` writes from the tensors themselves: no staging buffer is made."""
    from modelparallel.checkpoint.background.stager import Stager

    tsm.init({"tensor_parallel_degree": 1})
    model, optimizer = build()
    train_step(model, optimizer, 0)
    made = []
    original = Stager.buffer
    Stager.buffer = lambda self, key, t: made.append(key) or original(self, key, t)
    try:
        save("local", model, optimizer, root, None)
    finally:
        Stager.buffer = original
    want = local_state(model, optimizer)
    fresh, fresh_opt = load("local", root)
    assert differences(want, local_state(fresh, fresh_opt)) == []
    return len(made)


def test_a_synchronous_save_stages_nothing(tmp_path):
    assert harness.run(2, sync_save_copies_nothing, str(tmp_path)) == [0, 0]
