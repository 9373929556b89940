"""Saving and loading never change training: bit-identical runs with and without checkpoints.

A run that saves a partial checkpoint at steps 0 (optimizer never stepped), 1 and 5 must equal,
bit for bit, a run that never saves: every loss, every weight, every optimizer tensor, in fp32
and in fp16 (where a hidden optimizer step with AdamW's eps underflowing turned weights into
NaN; the fp16 runs here use an eps fp16 can represent, so the reference itself stays finite).
A run resumed into a fresh model and optimizer must continue exactly like the
uninterrupted one, including from a checkpoint of an optimizer that never stepped. A failure
means checkpoint/load/optim_part.py initialized or changed the live optimizer (torch's
``get_optimizer_state_dict`` runs a step to create empty states) or loaded another state.
The reference is the same code path without any checkpoint call (plain PyTorch training).
"""

import torch
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp

STEPS = 7


def build(seed: int, half: bool):
    smp.init({"tensor_parallel_degree": 2, "random_seed": seed, "fp16": half})
    cfg = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=8, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = smp.DistributedModel(GPT2LMHeadModel(cfg))
    # pure fp16 AdamW needs an eps fp16 can hold (1e-8 flushes to 0: 0/0 where a gradient is 0)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3 if half else 1e-8))
    return model, optimizer


def step(model, optimizer, i: int) -> float:
    ids = (torch.arange(16).reshape(2, 8) * (i + 3) + i) % 64
    loss = model(ids, labels=ids).loss
    model.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def everything(model, optimizer) -> dict[str, torch.Tensor]:
    """Every weight and optimizer tensor at its global shape (a collective)."""
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    out = {f"w/{k}": full(v) for k, v in model.module.state_dict().items()}
    names = {id(p): n for n, p in model.module.named_parameters()}
    for p, slots in optimizer.optimizer.state.items():
        out.update({f"o/{names[id(p)]}/{k}": full(v) for k, v in slots.items()})
    return out


def run(path: str | None, half: bool):
    """Train STEPS steps, saving before steps 0, 1 and 5 if ``path`` is given."""
    model, optimizer = build(0, half)
    losses = []
    for i in range(STEPS):
        if path is not None and i in (0, 1, 5):
            smp.save_checkpoint(path, f"s{i}", num_kept_partial_checkpoints=5)
            if i == 0:
                assert not optimizer.optimizer.state, "saving initialized the optimizer state"
        losses.append(step(model, optimizer, i))
    return losses, everything(model, optimizer)


def resumed(path: str, tag: str, start: int, half: bool):
    """A fresh model and optimizer (another seed), resumed from ``tag``, trained to STEPS."""
    model, optimizer = build(7, half)
    smp.resume_from_checkpoint(path, tag=tag)
    if start == 0:
        assert not optimizer.optimizer.state, "an un-stepped checkpoint loaded a non-empty state"
    losses = [step(model, optimizer, i) for i in range(start, STEPS)]
    return losses, everything(model, optimizer)


def assert_identical(a, b, what: str) -> None:
    (la, sa), (lb, sb) = a, b
    assert la == lb, f"{what}: losses differ: {la} vs {lb}"
    assert sorted(sa) == sorted(sb), f"{what}: {sorted(set(sa) ^ set(sb))}"
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), f"{what}: {k} differs"


def both_runs(path: str, half: bool):
    plain = run(None, half)
    saving = run(path, half)
    assert all(torch.isfinite(v).all() for v in plain[1].values() if v.is_floating_point())
    assert_identical(plain, saving, "saving vs not saving")
    for tag, start in (("s0", 0), ("s5", 5)):
        losses, state = resumed(path, tag, start, half)
        assert_identical((plain[0][start:], plain[1]), (losses, state), f"resumed from {tag}")
    return plain[0]


def test_checkpoints_change_nothing_fp32(tmp_path):
    harness.run(2, both_runs, str(tmp_path), False)


def test_checkpoints_change_nothing_fp16(tmp_path):
    harness.run(2, both_runs, str(tmp_path), True)


def gc_around_checkpoints(path: str):
    """Python's garbage collector during and after saves and a resume (the library pauses it
    while a checkpoint runs: a full collection set off by DCP's plans cost a save 0.27 s)."""
    import gc

    from modelparallel.checkpoint.save import partial

    build(0, False)
    seen, real = [], partial._Phases.run
    partial._Phases.run = lambda self, *a, **k: (seen.append(gc.isenabled()), real(self, *a, **k))[1]
    try:
        smp.save_checkpoint(path, "g")
        after_save = gc.isenabled()
        gc.disable()
        smp.save_checkpoint(path, "h")
        left_off = not gc.isenabled()
        gc.enable()
        smp.resume_from_checkpoint(path, tag="g")
    finally:
        partial._Phases.run = real
    return seen, after_save, left_off, gc.isenabled()


def test_the_garbage_collector_is_paused_during_a_checkpoint_and_put_back(tmp_path):
    for seen, after_save, left_off, after_resume in harness.run(2, gc_around_checkpoints, str(tmp_path)):
        assert seen == [False, False], "collector off while the save's phases run"
        assert after_save and after_resume, "collector on again after the save and the resume"
        assert left_off, "a collector the user had turned off stays off"
