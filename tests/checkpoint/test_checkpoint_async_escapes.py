"""Asynchronous saves against writes that replace or reach a deferred tensor's memory between the
call and its background copy, tried as training code might, in both ways a save detects a write
(the kernel's write tracking, ``background/pages.py``, and a CRC32 read at the call).

What must hold: a checkpoint is the state of its call, compared with a copy taken at the call
(after loading it back), or the save fails on every rank naming the tensor; a save during which
nothing wrote the saved memory never fails. A failure in the first test means a deferred tensor's
copy follows the tensor to other memory (``Stager.defer`` must copy from an alias of the call's
memory); in the others, a write escaped detection, a step was not held (``async_save.Job.hold``),
or memory freed after the call was taken for the saved tensor's.
"""

import ctypes
import gc
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import GPT2LMHeadModel

import harness
import modelparallel as smp
from modelparallel.checkpoint.api import _saver
from modelparallel.checkpoint.background.pages import PageWatch
from modelparallel.checkpoint.background.stager import StagedTensorChanged, Stager
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from ckpt_helpers import cfg, changed, snapshot
from state_helpers import recording_defers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed", "checkpoint"))  # v2 scripts' helpers
from test_v2_background_staging import differences, load, local_state, save  # noqa: E402
from v2_script import build, train_step  # noqa: E402

WAYS = ["pages", "read"]


def _ways(stager, way: str) -> None:
    """``pages``: write tracking for these small tensors (its size floors lowered); ``read``: CRC32s."""
    if way == "pages":
        stager.pages.min_bytes = stager.pages.min_save_bytes = 0
    else:
        stager.pages = None


def _deferred(way: str, t: torch.Tensor) -> tuple[Stager, torch.Tensor]:
    """A one-process save's call up to its seal: ``t`` deferred (stager, its buffer)."""
    stager = Stager()
    stager.pages = PageWatch.open() if way == "pages" else None
    if stager.pages is not None:
        stager.pages.min_save_bytes = 0
    stager.begin()
    buf = stager.buffer(("t",), t)
    stager.defer("t", t, t, buf)
    assert (stager.deferred[0].pages is not None) == (way == "pages"), "the way under test is not the one used"
    return stager, buf


def _rebind(t: torch.Tensor) -> None:
    """``t`` given other memory: the call's values but one."""
    t.data = t.detach().clone()
    t.data.view(-1)[t.numel() // 2] = 5.0


@pytest.mark.parametrize("way", WAYS)
def test_a_tensor_moved_to_other_memory_after_the_call_is_copied_from_the_calls_memory(way):
    """``t.data = x`` / ``swap_tensors`` rebind the object ``defer`` was given; the copy must read
    the call's memory (kept alive), never the new memory unseen by the call's protections."""
    n = 1 << 18
    moves = {"data = edited clone": _rebind, "data = zeros": lambda t: setattr(t, "data", torch.zeros(n)),
             "swap_tensors": lambda t: torch.utils.swap_tensors(t, torch.zeros(n))}
    for what, move in moves.items():
        t = torch.randn(n)
        want = t.clone()
        stager, buf = _deferred(way, t)
        stager.seal()
        move(t)
        gc.collect()
        stager.copy_deferred()
        stager.settle()
        assert torch.equal(buf, want), f"{what}: the copy holds memory the tensor was moved to after the call"


@pytest.mark.parametrize("way", WAYS)
def test_writes_from_another_thread_around_the_call(way):
    """A thread writing all through the call and the copy fails the save; one write that lands in
    the call before its protections (``seal``) gives either a failure or the value at the call's end."""
    t, stop = torch.randn(1 << 18), threading.Event()

    def keep_writing():
        while not stop.is_set():
            t.data[1000] += 1.0

    writer = threading.Thread(target=keep_writing)
    writer.start()
    stager, _ = _deferred(way, t)
    stager.seal()
    time.sleep(0.01)
    with pytest.raises(StagedTensorChanged, match="t"):
        stager.copy_deferred()
    stop.set()
    writer.join()
    stager, buf = _deferred(way, t)
    one = threading.Thread(target=lambda: t.data.__setitem__(t.numel() // 2, -1.0))
    one.start()
    one.join()
    stager.seal()
    at_return = t.clone()
    try:
        stager.copy_deferred()
        assert torch.equal(buf, at_return), "neither a failure nor the value at the call's return"
    except StagedTensorChanged:
        pass
    stager.settle()


@torch.no_grad()  # the local tensor itself, as an in-place edit under no_grad gets it (not an autograd view)
def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _job(extra: dict, opt_kw: dict):
    smp.init({"random_seed": 0, **extra})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT2LMHeadModel(cfg(n_embd=64, n_layer=2)))  # c_fc's shard: 32 kB
    lr = torch.tensor(1e-2) if opt_kw.pop("tensor_lr", False) else 1e-2  # made here: one handed over is shared memory
    return model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=lr, **opt_kw))


def _state(model, optimizer) -> dict:
    """``snapshot`` (tensor hyperparameters cloned) with the fp32 masters."""
    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in snapshot(model, optimizer).items()}
    names = {id(p): n for n, p in model.module.named_parameters()}
    out.update({f"master/{names[id(p)]}": _local(m).clone() for p, m in optimizer.master_weights.pairs})
    return out


@smp.step
def _fwd_bwd(model, ids):
    out = model(ids, labels=ids)
    model.backward(out.loss)
    return out.loss


def _ids(i: int) -> torch.Tensor:
    return (torch.arange(16).reshape(2, 8) * (i + 1)) % 64


def _v1_edits(model, optimizer) -> dict:
    """name -> (what may happen: "call" (the checkpoint holds the call's values) and/or the tensor a
    failure names, edit). A tensor given other memory may fail the save (its version counter moved)."""
    w = model.module.transformer.h[0].mlp.c_fc.weight
    local, slot = _local(w), _local(optimizer.optimizer.state[w]["exp_avg"])
    n, at = local.numel(), local.data_ptr() + 4 * (local.numel() // 2)
    name, slot_name = "model.transformer.h.0.mlp.c_fc.weight", "state.transformer.h.0.mlp.c_fc.weight.exp_avg"

    class Raw:
        __array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (local.data_ptr(), False), "version": 3}

    def second_optimizer():
        w.grad = torch.ones_like(w)
        torch.optim.SGD([w], lr=0.1).step()
        w.grad = None

    def torch_load():
        sd = optimizer.optimizer.state_dict()
        optimizer.optimizer.load_state_dict({"param_groups": sd["param_groups"], "state": {
            k: {s: v * 2 if v.dim() else v.clone() for s, v in st.items()} for k, st in sd["state"].items()}})

    return {
        "slot .data = edited clone": ("call", lambda: _rebind(slot)),
        "param .data = edited clone": ("call", lambda: _rebind(local)),
        "vector_to_parameters": ("call", lambda: torch.nn.utils.vector_to_parameters(torch.zeros(n), [local])),
        "optimizer.state[p] = new": ("call", lambda: optimizer.optimizer.state.__setitem__(
            w, {k: v * 3 if v.dim() else v.clone() for k, v in optimizer.optimizer.state[w].items()})),
        "torch optimizer load_state_dict": ("call", torch_load),
        "backward only (accumulation)": ("call", lambda: _fwd_bwd(model, _ids(3))),
        "slot swap_tensors": (("call", slot_name), lambda: torch.utils.swap_tensors(slot, torch.zeros_like(slot))),
        "slot set_": (("call", slot_name), lambda: slot.set_(torch.zeros_like(slot))),
        "module.load_state_dict": ("model.transformer.wte.weight", lambda: model.module.load_state_dict(
            {k: v * 2 for k, v in model.module.state_dict().items()})),
        "a second optimizer's step": (name, second_optimizer),
        "torch.from_numpy": (name, lambda: torch.from_numpy(local.detach().numpy()).view(-1).__setitem__(n // 2, 5)),
        "DLPack": (name, lambda: torch.from_dlpack(local.detach()).view(-1).__setitem__(n // 3, 5.0)),
        "__array_interface__": (name, lambda: np.asarray(Raw()).__setitem__(n // 2, 9.0)),
        "ctypes.memmove": (name, lambda: ctypes.memmove(at, (ctypes.c_float * 1)(7.5), 4)),
    }


def v1_edits(path: str, way: str) -> dict:
    model, optimizer = _job({"tensor_parallel_degree": 2}, {})
    _fwd_bwd(model, _ids(0))
    optimizer.step()
    optimizer.zero_grad()
    stager, watched, out = _saver().stager, set(), {}
    stager.defer = recording_defers(stager, watched)
    _ways(stager, way)
    for i, what in enumerate(_v1_edits(model, optimizer)):
        expect, edit = _v1_edits(model, optimizer)[what]  # the tensors as they are now (a resume may replace them)
        release = threading.Event()
        stager.before_copy = release.wait
        smp.save_checkpoint(path, f"e{i}", async_save=True)
        want = _state(model, optimizer)
        edit()
        release.set()
        try:
            smp.wait_for_checkpoints()
        except Exception as e:  # noqa: BLE001 - the message is compared
            out[what] = (expect, str(e))
            continue
        smp.resume_from_checkpoint(path, tag=f"e{i}")
        out[what] = (expect, changed(want, _state(model, optimizer)) or "call")
        optimizer.zero_grad()
    return {"out": out, "watched": watched}


@pytest.mark.parametrize("way", WAYS)
def test_v1_writes_and_replacements_between_the_call_and_the_copy(tmp_path, way):
    for r in harness.run(2, v1_edits, str(tmp_path), way):
        edited = {"model.transformer.h.0.mlp.c_fc.weight",
                  "optimizer.optimizer.state.transformer.h.0.mlp.c_fc.weight.exp_avg"}
        assert (way == "pages") == (edited <= r["watched"]), r["watched"]
        for what, (expect, got) in r["out"].items():
            assert any(got == e if e == "call" else f"staged: {e}" in got or f"optimizer.{e}" in got
                       for e in ((expect,) if isinstance(expect, str) else expect)), (what, got)


def v1_loop(path: str, extra: dict, way: str, opt_kw: dict, accumulate: int) -> dict:
    """Five saves, each followed by a held step (forward and backward run while staging waits)."""
    model, optimizer = _job(extra, opt_kw)
    stager = _saver().stager
    _ways(stager, way)
    go = threading.Event()  # staging waits until a step begins (a global hook runs before the save's own)
    stager.before_copy = lambda: (go.wait(30), go.clear())
    hook = register_optimizer_step_pre_hook(lambda *_: go.set())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, 1, gamma=0.5)
    want, held = {}, 0.0
    for i in range(5):
        smp.save_checkpoint(path, f"s{i}", async_save=True)
        want[i] = _state(model, optimizer)
        for j in range(accumulate):
            _fwd_bwd(model, _ids(i + j))
        optimizer.step()
        held += _saver().job.held_s
        scheduler.step()
        optimizer.zero_grad()
    smp.wait_for_checkpoints()
    hook.remove()
    stager.before_copy = None
    moved = changed(want[0], _state(model, optimizer))
    diffs = []
    for i in range(5):
        smp.resume_from_checkpoint(path, tag=f"s{i}")
        diffs += [(i, k) for k in changed(want[i], _state(model, optimizer))]
    return {"diffs": diffs, "moved": len(moved), "held": held}


LOOPS = {"foreach": ({"tensor_parallel_degree": 2}, "read", {}, 1),
         "fused, tensor lr, accumulation": ({"tensor_parallel_degree": 2}, "pages",
                                            {"fused": True, "tensor_lr": True}, 2),
         "bf16 masters": ({"tensor_parallel_degree": 2, "bf16": True}, "read", {"foreach": False}, 1),
         "fp16 masters": ({"tensor_parallel_degree": 2, "fp16": True}, "pages", {}, 1),
         "pipeline": ({"pipeline_parallel_degree": 2, "microbatches": 2}, "read", {}, 2)}


@pytest.mark.parametrize("case", list(LOOPS))
def test_v1_save_every_step_never_fails_and_holds_each_call(tmp_path, case):
    for r in harness.run(2, v1_loop, str(tmp_path), *LOOPS[case]):
        assert r["moved"] and r["held"] > 0, f"nothing to prove: {r}"
        assert r["diffs"] == [], r["diffs"][:5]


def v2_loop(root: str, kind: str, way: str) -> dict:
    """v2 ``async_save`` every step; the state dict handed over is dropped, collected and its memory
    reused before the copy; a second optimizer steps (held) and the optimizer's state is replaced."""
    smp.init({"tensor_parallel_degree": 1})
    model, optimizer = build()
    train_step(model, optimizer, 0)
    queue, go, junk, watched, want, held = AsyncCallsQueue(), threading.Event(), [], set(), {}, 0.0
    stager = queue.saver.stager
    stager.defer = recording_defers(stager, watched)
    _ways(stager, way)
    stager.before_copy = lambda: (go.wait(30), gc.collect(),  # then freed memory is taken and written
                                  junk.append([torch.full((n,), 7.0) for n in (1 << 12, 1 << 16)]))
    hook = register_optimizer_step_pre_hook(lambda *_: go.set())
    for i in range(4):
        go.clear()
        save(kind, model, optimizer, os.path.join(root, f"s{i}"), queue)
        want[i] = local_state(model, optimizer)
        if i == 1:
            for q in model.parameters():
                q.grad = torch.ones_like(q)
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        if i == 2:
            sd = optimizer.state_dict()
            optimizer.load_state_dict({"param_groups": sd["param_groups"], "state": {
                k: {s: v * 2 for s, v in st.items()} for k, st in sd["state"].items()}})
        train_step(model, optimizer, i + 1)
        held += queue.saver.job.held_s
    queue.maybe_finalize_async_calls(blocking=True)
    hook.remove()
    diffs = [(i, k) for i in range(4)
             for k in differences(want[i], local_state(*load(kind, os.path.join(root, f"s{i}"))))]
    return {"diffs": diffs, "held": held, "watched": len(watched)}


@pytest.mark.parametrize("kind, way", [("local", "pages"), ("sharded", "read")])
def test_v2_save_every_step_with_the_state_dict_dropped_and_a_second_optimizer(tmp_path, kind, way):
    for r in harness.run(2, v2_loop, str(tmp_path), kind, way):
        assert r["held"] > 0 and (r["watched"] > 0) == (way == "pages"), r
        assert r["diffs"] == [], r["diffs"][:5]
