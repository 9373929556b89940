"""Features that each have their own tests, combined as a SageMaker v1 script combines them.

1. Resume at another layout (tp2 -> tp1, tp2 -> tp1 x dp2, pp2 -> pp1): a torch optimizer at its
   CUDA-style setting (``foreach`` / ``fused``), in fp32, bf16 or fp16 with dynamic loss scaling,
   a partial checkpoint saved (asynchronously or not) while training goes on. The reference is
   one plain PyTorch process started from the state the saving job held (weights, fp32 masters,
   optimizer slots, loss-scale counters): the resumed state equals it bit for bit; each step's
   loss and gradients equal the reference's up to reordered rounding (``reference.tolerance``;
   in half precision plus NOISE_FACTOR times the reference's own distance from the same weights
   evaluated in fp32); given those gradients the update is elementwise arithmetic on the same
   numbers, so masters and weights are equal bit for bit, and the loss scale grows on time.
2. After such a resume, the full exports (training dtype, asynchronous; fp32 masters) load with
   plain ``from_pretrained`` in their saved dtype, holding exactly the job's weights.

(Gradient accumulation x pipeline x activation checkpointing x delayed init is in
``test_combination_accumulation.py``; the jobs both run are in ``combination_jobs.py``.)

A failure in the state comparison points at the checkpoint's optimizer part or the masters
(modelparallel/checkpoint/load/optim_part.py, training/optimizer_state.py); in a step at how the
resumed optimizer steps (optimizer.py, training/master_weights.py); in case 2 at
checkpoint/save/full.py.
"""

import copy

import pytest
import torch

import harness
import modelparallel as smp
from combination_jobs import (LR, MODELS, SCALING, _assert_equal, _batch, _hf, _job, _merged, _state, _step,
                              resume_and_train, save_then_go_on)
from reference import NOISE_FACTOR, tolerance


class Reference:
    """One process: an fp32 model holding the saved masters and a torch optimizer holding the saved
    slots; in half precision a copy in the training dtype computes the loss and gradients."""

    def __init__(self, saved, arch, dtype, opt_name, opt_kwargs):
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype, torch.float32)
        self.masters = MODELS[arch]()
        self.named = dict(self.masters.named_parameters())
        with torch.no_grad():
            for name, p in self.named.items():
                p.copy_(_hf(saved["stepped"][name], p))
        self.opt = getattr(torch.optim, opt_name)(self.masters.parameters(), lr=LR[opt_name], **opt_kwargs)
        order = [n for n, _ in self.masters.named_parameters()]
        self.opt.load_state_dict({
            "state": {i: {k: _hf(v, self.named[n]) if torch.is_tensor(v) and v.dim() else v
                          for k, v in saved["slots"][n].items()} for i, n in enumerate(order)},
            "param_groups": self.opt.state_dict()["param_groups"]})
        self.scaler = dict(saved["scaler"])

    def loss_and_grads(self, ids):
        """The loss and gradients in the training dtype, and per name how far they are from the
        same weights evaluated in fp32 (the rounding a half-precision evaluation carries; 0 in fp32)."""
        half = copy.deepcopy(self.masters).to(self.dtype)
        twin = copy.deepcopy(half).float()
        out = {}
        for model in (half, twin):
            loss = model(ids, labels=ids).loss
            loss.backward()
            out[model is half] = loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}
        (loss, grads), (loss32, grads32) = out[True], out[False]
        noise = {n: (g - grads32[n]).abs().max().item() for n, g in grads.items()}
        return loss, grads, abs(loss - loss32).item(), noise

    def scale_after_good_step(self) -> float:
        """SageMaker's dynamic rule (scale_window 2, factor 2) from the saved counters: the scale
        for the next step."""
        if "good_steps" in self.scaler:
            self.scaler["good_steps"] += 1
            if self.scaler["good_steps"] >= SCALING["dynamic_loss_args"]["scale_window"]:
                self.scaler.update(good_steps=0, loss_scale=self.scaler["loss_scale"] * 2)
        return self.scaler["loss_scale"]

    def step(self, grads, scale):
        """The masters step on the given gradients unscaled as fp32 (multiplied by 1/scale)."""
        for name, p in self.named.items():
            g = _hf(grads[name], p).to(torch.float32)
            p.grad = g.mul_(1.0 / scale) if scale != 1.0 else g
        self.opt.step()
        self.opt.zero_grad()


def check_resume(tmp_path, arch, dtype, opt_name, opt_kwargs, save, load, async_save):
    (world_a, layout_a), (world_b, layout_b) = save, load
    path = str(tmp_path)
    first = harness.run(world_a, save_then_go_on, path, layout_a, dtype, arch, opt_name, opt_kwargs, async_save)
    second = harness.run(world_b, resume_and_train, path, layout_b, dtype, arch, opt_name, opt_kwargs)
    saved = _merged(first)
    loaded = _merged([s for s, _ in second])
    assert set(loaded["stepped"]) <= set(saved["stepped"]), "a weight tied across stages is saved by each"
    for name in loaded["stepped"]:  # the new layout's names: a tied weight once
        want = saved["stepped"][name]
        _assert_equal(loaded["stepped"][name], want, f"resumed master {name}")
        # sharded data parallelism keeps fp32 shards (cast for the forward): compare in the lower precision
        got_w, want_w = loaded["params"][name], saved["params"][name]
        low = min((got_w.dtype, want_w.dtype), key=lambda d: torch.finfo(d).bits)
        _assert_equal(got_w.to(low), want_w.to(low), f"resumed weight {name}")
        for k, v in saved["slots"][name].items():
            got = loaded["slots"][name][k]
            assert (torch.equal(got, v) if torch.is_tensor(v) else got == v), f"resumed {k} of {name}"
    assert loaded["scaler"] == saved["scaler"], "loss-scale counters"
    ref = Reference(saved, arch, dtype, opt_name, opt_kwargs)
    steps = [[r[i] for _, r in second] for i in range(2)]
    for i, per_rank in enumerate(steps):
        got = _merged(per_rank)
        ids = _batch(3 + i)
        want_loss, want_grads, loss_noise, noise = ref.loss_and_grads(ids)
        assert not got["overflow"]
        torch.testing.assert_close(torch.tensor(got["loss"]), want_loss, rtol=0,
                                   atol=tolerance(want_loss) + NOISE_FACTOR * loss_noise,
                                   msg=lambda m: f"step {3 + i} loss: {m}")
        scale = got["scale"]
        assert scale == (ref.scaler["loss_scale"] if i == 0 else ref.scale_after_good_step()), (i, scale, ref.scaler)
        for name, want in want_grads.items():
            torch.testing.assert_close(_hf(got["grads"][name], want).float() / scale, want, rtol=0,
                                       atol=tolerance(want) + NOISE_FACTOR * noise[name],
                                       msg=lambda m, n=name: f"step {3 + i} grad {n}: {m}")
        ref.step(got["grads"], scale)
        for name, p in ref.named.items():
            _assert_equal(_hf(got["after"]["stepped"][name], p), p.detach(), f"step {3 + i} master {name}")
            _assert_equal(_hf(got["after"]["params"][name], p).to(ref.dtype), p.detach().to(ref.dtype),
                          f"step {3 + i} weight {name}")


TP2 = (2, {"tensor_parallel_degree": 2, "prescaled_batch": True})
PP2 = (2, {"pipeline_parallel_degree": 2, "microbatches": 2})
TP1 = (1, {})
TP1_DP2 = (2, {})
SDP2 = (2, {"sharded_data_parallel_degree": 2})


@pytest.mark.parametrize("arch, dtype, opt_name, opt_kwargs, save, load, async_save", [
    ("gpt2", "bf16", "AdamW", {"foreach": True}, TP2, TP1_DP2, True),
    ("gpt2", "fp16", "AdamW", {"fused": True}, TP2, TP1, False),
    ("gpt2", "fp32", "SGD", {"momentum": 0.9, "foreach": True}, PP2, TP1_DP2, True),
    ("llama", "fp16", "AdamW", {"foreach": True}, PP2, TP1, True),
    ("gpt2", "fp16", "AdamW", {"foreach": True}, TP2, SDP2, True),  # fp32 shards take the saved masters
    ("gpt2", "fp16", "AdamW", {"foreach": True}, SDP2, TP2, False),  # masters from the saved fp32 shards
])
def test_resume_at_another_layout_steps_like_one_process(tmp_path, arch, dtype, opt_name, opt_kwargs, save, load,
                                                         async_save):
    check_resume(tmp_path, arch, dtype, opt_name, opt_kwargs, save, load, async_save)


# ---- a full export after a resume at another layout, read by plain from_pretrained -------------

def resume_then_export(path, out, layout, dtype, arch, opt_name, opt_kwargs):
    """Resume, one step, then the two exports a half-precision run offers: the training dtype
    (asynchronously) and the fp32 masters."""
    model, opt = _job(layout, dtype, arch, opt_name, opt_kwargs, seed=7)
    smp.resume_from_checkpoint(path, tag="s3")
    _step(model, opt, 3)
    smp.save_checkpoint(out, tag="half", partial=False, model=model, async_save=True)
    smp.save_checkpoint(out, tag="fp32", partial=False, model=model, dtype=torch.float32)
    smp.wait_for_checkpoints()
    return _state(model, opt)


@pytest.mark.parametrize("arch, save, load", [("gpt2", PP2, (2, {"tensor_parallel_degree": 2})),
                                              ("llama", TP2, PP2)])
def test_full_export_after_a_resume_at_another_layout_loads_in_hugging_face(tmp_path, arch, save, load):
    from transformers import AutoModelForCausalLM

    harness.run(save[0], save_then_go_on, str(tmp_path / "ckpt"), save[1], "fp16", arch, "AdamW", {"foreach": True},
                True)
    held = _merged(harness.run(load[0], resume_then_export, str(tmp_path / "ckpt"), str(tmp_path / "out"), load[1],
                               "fp16", arch, "AdamW", {"foreach": True}))
    for tag, key, dtype in (("half", "params", torch.float16), ("fp32", "stepped", torch.float32)):
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / tag, dtype="auto")  # the dtype saved
        theirs = dict(hf.named_parameters())
        assert {p.dtype for p in theirs.values()} == {dtype}, tag
        assert theirs.keys() == held[key].keys(), tag
        for name, p in theirs.items():
            _assert_equal(p.detach(), _hf(held[key][name], p), f"{tag} export of {name}")
        assert (hf.lm_head.weight is hf.get_input_embeddings().weight) == (arch == "gpt2"), f"{tag}: tie as configured"
