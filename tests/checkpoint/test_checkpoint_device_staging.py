"""The ways an asynchronous save stages a GPU tensor without pinning memory in the call
(``modelparallel/checkpoint/background/device.py``), run here on host tensors sent down the same
paths (``Stager.on_device``): a snapshot taken by the call (``SNAPSHOT``: later edits never reach
the checkpoint, the step is not held) and a live copy made by the background thread, checked by
``word_sum`` (``LIVE``: an edit through ``.data`` or numpy before the copy fails the save).

A failure means ``device.word_sum`` differs from the plain sum of the bytes, ``device.Room``
handed out more than it had, or ``Stager._on_device`` / ``Deferred.copy`` let a change after the
call reach a checkpoint, or refused an unchanged one. The CUDA parts (streams, events, pinned
buffers) run in tests/gpu on a GPU machine.
"""

import threading

import numpy as np
import pytest
import torch

import harness
import modelparallel as smp
from modelparallel.checkpoint.api import _saver
from modelparallel.checkpoint.background import device
from modelparallel.checkpoint.background.deferred import LIVE, SNAPSHOT
from modelparallel.checkpoint.background.stager import StagedTensorChanged, Stager
from modelparallel.checkpoint.safety import commit
from ckpt_helpers import build, changed, error_of, snapshot
from test_checkpoint_async_staging import _edits


def _numpy_word_sum(t: torch.Tensor, chunk: int) -> int:
    """The fingerprint computed independently: little-endian words of the widest size the byte
    count allows, per-chunk sums weighted by position, all modulo 2**64."""
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    width = 8 if len(raw) % 8 == 0 else 4 if len(raw) % 4 == 0 else 1
    words = np.frombuffer(raw, dtype={8: "<i8", 4: "<i4", 1: "u1"}[width]).astype(object)
    total = 0
    for i in range(0, len(words), chunk):
        total += int(sum(int(w) for w in words[i:i + chunk])) * (i // chunk + 1)
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


@pytest.mark.parametrize("dtype,n", [(torch.float32, 37), (torch.bfloat16, 50), (torch.bfloat16, 7),
                                     (torch.int64, 9), (torch.uint8, 13)])
def test_word_sum_is_the_weighted_sum_of_the_bytes(monkeypatch, dtype, n):
    monkeypatch.setattr(device, "CHUNK_WORDS", 4)  # several chunks
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 1e4).to(dtype) if dtype.is_floating_point \
        else torch.randint(0, 120, (n,), generator=g).to(dtype)
    assert int(device.word_sum(t)) == _numpy_word_sum(t, 4)
    flipped = t.clone()
    flipped.view(torch.uint8)[n // 2] ^= 1
    assert int(device.word_sum(flipped)) != int(device.word_sum(t)), "a one-bit change was not seen"


def test_room_hands_out_no_more_than_it_has():
    room = device.Room(lambda dev: 100)
    a, b = torch.zeros(16), torch.zeros(10)  # 64 and 40 bytes
    assert room.take(a) and not room.take(b) and room.take(torch.zeros(9)) and not room.take(torch.zeros(1))


def _forced(spare: int) -> Stager:
    stager = Stager()
    stager.on_device = lambda t: True
    stager.spare = lambda dev: spare
    stager.begin()
    return stager


def test_a_live_copy_names_a_tensor_changed_through_data():
    stager = _forced(0)
    kept, edited = torch.arange(12.0), torch.arange(10, dtype=torch.bfloat16)
    for name, t in (("kept", kept), ("edited", edited)):
        stager.defer(name, t, t, stager.buffer((name,), t))
    assert [d.kind for d in stager.deferred] == [LIVE, LIVE]
    edited.data.mul_(3)
    with pytest.raises(StagedTensorChanged, match="edited") as e:
        stager.copy_deferred(live=True)
    assert "kept" not in str(e.value)
    assert torch.equal(stager.buffers[("kept",)], torch.arange(12.0))


def test_a_snapshot_keeps_the_values_of_the_call_and_is_not_live():
    stager = _forced(48)  # room for the first tensor only
    first, second = torch.arange(12.0), torch.arange(3.0)
    for name, t in (("first", first), ("second", second)):
        stager.defer(name, t, t, stager.buffer((name,), t))
    assert [d.kind for d in stager.deferred] == [SNAPSHOT, LIVE]
    stager.copy_deferred(live=True)  # the live one, unchanged
    first.data.mul_(2)  # after the call: a snapshot never sees it
    stager.copy_deferred(live=False)
    assert torch.equal(stager.buffers[("first",)], torch.arange(12.0))
    assert torch.equal(stager.buffers[("second",)], torch.arange(3.0)) and stager.deferred == []


def _error_or_none() -> str | None:
    try:
        return error_of(smp.wait_for_checkpoints)
    except AssertionError:  # it raised nothing
        return None


def _noted(deferred, kinds: set):
    kinds.add(deferred.kind)
    return deferred


def device_ways(path: str, spare: int) -> dict:
    """Asynchronous saves with the stager's device ways forced on host tensors (``spare``: 0 for
    live copies, plenty for snapshots); each edit is made while the background copy is held."""
    model, optimizer = build()
    stager = _saver().stager
    stager.on_device, stager.spare = (lambda t: True), (lambda dev: spare)
    kinds, way = set(), stager._on_device
    stager._on_device = lambda *args: _noted(way(*args), kinds)
    smp.save_checkpoint(path, "a", async_save=True)
    smp.wait_for_checkpoints()
    out, want = {}, None
    for i, (what, edit) in enumerate(_edits(model, optimizer).items()):
        release = threading.Event()
        stager.before_copy = release.wait
        smp.save_checkpoint(path, f"b{i}", async_save=True)
        out.setdefault("kinds", sorted(kinds))
        want = snapshot(model, optimizer)
        # live copies hold the step until the (paused) copy is done; snapshots release it at once
        out.setdefault("released", _saver().job.staged.wait(30 if spare else 0.3))
        edit()
        release.set()
        out[what] = _error_or_none()
    stager.before_copy = None
    smp.barrier()
    out["newest"] = commit.read_newest(path)
    fresh, fresh_opt = build(seed=5)
    smp.resume_from_checkpoint(path)
    out["diff"] = changed(want, snapshot(fresh, fresh_opt))
    return out


def test_live_device_copies_fail_a_save_edited_before_its_copy(tmp_path):
    results = harness.run(2, device_ways, str(tmp_path), 0)
    for r in results:
        assert r["kinds"] == [LIVE] and not r["released"], r
        for what in ("data.clamp_", "data.mul_", "numpy view"):
            assert "model.transformer.h.0.mlp.c_fc.weight" in r[what] and "changed in place" in r[what], (what, r)
        assert "changed in place" in r["exp_avg.data.zero_"] and "exp_avg" in r["exp_avg.data.zero_"], r
        assert r["newest"] == "a_partial", r


def test_device_snapshots_keep_the_call_values_whatever_changes_after(tmp_path):
    for r in harness.run(2, device_ways, str(tmp_path), 1 << 40):
        assert r["kinds"] == [SNAPSHOT] and r["released"], r
        assert all(r[what] is None for what in ("data.clamp_", "data.mul_", "numpy view", "exp_avg.data.zero_")), r
        assert r["newest"] == "b3_partial" and r["diff"] == [], r


def test_the_pinner_swaps_every_buffer_and_none_after_a_halt():
    """Pinning (here: any new allocation) replaces each pageable buffer under the lock; after
    ``halt`` returns no buffer changes, though an allocation was in hand."""
    lock = threading.Lock()
    buffers = {k: torch.zeros(4) for k in "abc"}
    pinner = device.Pinner(lock, allocate=lambda old: torch.ones(4))
    pageable = set(buffers)
    pinner.start(buffers, pageable)
    pinner.join()
    assert pageable == set() and all(torch.equal(b, torch.ones(4)) for b in buffers.values())
    entered, go = threading.Event(), threading.Event()

    def slow(old):
        entered.set()
        go.wait(30)
        return torch.full((4,), 2.0)

    buffers, pageable = {k: torch.zeros(4) for k in "ab"}, {"a", "b"}
    pinner = device.Pinner(lock, allocate=slow)
    pinner.start(buffers, pageable)
    assert entered.wait(30)
    pinner.halt()  # returns at once, the allocation still in hand
    go.set()
    pinner.stop()
    assert pageable == {"a", "b"} and all(torch.equal(b, torch.zeros(4)) for b in buffers.values())


def test_the_room_on_a_gpu_is_what_the_peak_leaves_and_none_before_a_step(monkeypatch):
    """``spare_bytes`` with the CUDA memory queries answered here: free + reserved - peak reserved
    - the margin (1 GiB or a twentieth of the device), and nothing while the allocated peak is
    not yet an eighth above what is held (no forward and backward seen)."""
    gib = 1 << 30
    answers = {"mem_get_info": (30 * gib, 80 * gib), "memory_reserved": 40 * gib, "max_memory_reserved": 50 * gib,
               "memory_allocated": 32 * gib, "max_memory_allocated": 44 * gib}
    for name, value in answers.items():
        monkeypatch.setattr(torch.cuda, name, lambda dev, v=value: v)
    gpu = torch.device("cuda", 0)
    assert device.spare_bytes(gpu) == 30 * gib + 40 * gib - 50 * gib - 4 * gib
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: 32 * gib + 32 * gib // 8 - 1)
    assert device.spare_bytes(gpu) == 0
    assert device.spare_bytes(torch.device("cpu")) == 0
