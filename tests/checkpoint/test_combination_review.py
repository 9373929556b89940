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
2. Gradient accumulation (``backward_passes_per_step`` over ``@smp.step`` calls of 2
   microbatches) x pipeline (x TP or x data parallel) x ``smp.set_activation_checkpointing`` x
   delayed init: one step equals the plain model's from the same initial values.
3. After such a resume, the full exports (training dtype, asynchronous; fp32 masters) load with
   plain ``from_pretrained`` in their saved dtype, holding exactly the job's weights.

A failure in the state comparison points at the checkpoint's optimizer part or the masters
(modelparallel/checkpoint/load/optim_part.py, training/optimizer_state.py); in a step at how the
resumed optimizer steps (optimizer.py, training/master_weights.py); in case 2 at the microbatch
scaling (``DistributedModel.backward``) or the pipeline's recompute; in case 3 at
checkpoint/save/full.py.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from reference import NOISE_FACTOR, _fp32_gradient_noise, count_block_runs, gathered, tolerance

VOCAB = 64
LR = {"AdamW": 1e-2, "SGD": 1e-1}
SCALING = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0 ** 8, "scale_window": 2}}
"""fp16's dynamic loss scale, small enough that no step of these tiny models overflows, growing every
second step: the counter of good steps must survive the resume for the scale to grow on time."""


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def _llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=16, tie_word_embeddings=False))


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _batch(step: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(10 + step))


@smp.step
def _train_step(model, ids):
    out = model(ids, labels=ids)
    model.backward(out.loss)
    return out.loss


def _full(t):
    return gathered(t.detach()).clone()


def _job(layout: dict, dtype: str, arch: str, opt_name: str, opt_kwargs: dict, seed: int):
    smp.init({**layout, "fp16": dtype == "fp16", "bf16": dtype == "bf16", "random_seed": seed})
    torch.manual_seed(seed)
    model = smp.DistributedModel(MODELS[arch]())
    inner = getattr(torch.optim, opt_name)(model.parameters(), lr=LR[opt_name], **opt_kwargs)
    opt = smp.DistributedOptimizer(inner, **(SCALING if dtype == "fp16" else {}))
    return model, opt


def _state(model, opt) -> dict:
    """What this rank's stage holds, gathered over its tensor-parallel group (a collective there),
    by Hugging Face name: the stepped fp32 tensor (master or parameter), the model's parameter,
    the optimizer's slots."""
    out = {"params": {}, "stepped": {}, "slots": {}, "scaler": dict(opt.loss_scaler.state_dict())}
    for name, p in model.module.named_parameters():
        master = opt.master_weights.master_of(p)
        out["params"][name] = _full(p)
        out["stepped"][name] = _full(p if master is None else master)
        out["slots"][name] = {k: _full(v) if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
    return out


def _step(model, opt, step: int) -> dict:
    """One step; returns the mean loss over the data-parallel replicas, the gradients the optimizer
    is given (gathered, in the model's dtype, still multiplied by the loss scale), that scale,
    and the state after the step."""
    loss = _train_step(model, _batch(step)).reduce_mean().detach().float()
    dist.all_reduce(loss)
    loss /= dist.get_world_size()
    grads = {n: _full(p.grad) for n, p in model.module.named_parameters()}
    scale = opt.loss_scaler.loss_scale
    opt.step()
    overflow = opt.overflow
    opt.zero_grad()
    return {"loss": loss.item(), "grads": grads, "scale": scale, "overflow": overflow, "after": _state(model, opt)}


def save_then_go_on(path, layout, dtype, arch, opt_name, opt_kwargs, async_save):
    model, opt = _job(layout, dtype, arch, opt_name, opt_kwargs, seed=1)
    for step in range(3):
        _step(model, opt, step)
    smp.save_checkpoint(path, tag="s3", model=model, optimizer=opt, async_save=async_save)
    saved = _state(model, opt)
    for step in range(3, 5):  # changes what an asynchronous save must not see
        _step(model, opt, step)
    smp.wait_for_checkpoints()
    return saved


def resume_and_train(path, layout, dtype, arch, opt_name, opt_kwargs):
    model, opt = _job(layout, dtype, arch, opt_name, opt_kwargs, seed=7)  # other weights: the resume replaces them
    smp.resume_from_checkpoint(path, tag="s3")
    loaded = _state(model, opt)
    return loaded, [_step(model, opt, step) for step in range(3, 5)]


def _merged(per_rank: list[dict]) -> dict:
    """Every stage's part as one dict (ranks of a stage hold the same values): the by-name entries
    united, the rest rank 0's."""
    return {k: ({n: t for r in per_rank for n, t in r[k].items()} if k in BY_NAME else
                _merged([r[k] for r in per_rank]) if k == "after" else v) for k, v in per_rank[0].items()}


BY_NAME = ("params", "stepped", "slots", "grads", "initial", "weights")


def _assert_equal(got, want, what):
    assert got.dtype == want.dtype and torch.equal(got, want), \
        f"{what}: max difference {(got.double() - want.double()).abs().max().item()}"


def _hf(t, like):
    return t.reshape(like.shape)  # packed GPT-2 c_attn [in, 3, out/3] is HF's [in, out] reshaped


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


# ---- gradient accumulation x pipeline x activation checkpointing x delayed init ---------------

def accumulated_step(layout, passes):
    """Llama built in ``smp.delay_param_initialization()``, split over the pipeline (and TP) ranks,
    each stage's decoder layers checkpointed by ``smp.set_activation_checkpointing``, ``passes``
    ``@smp.step`` calls of 2 microbatches each accumulated (``backward_passes_per_step``), one
    fused-AdamW step. Returns the losses, the gradients the step used, the weights after it and
    how often each local block ran (a forward and a recompute per microbatch when checkpointed)."""
    smp.init({**layout, "microbatches": 2, "delayed_parameter_initialization": True, "random_seed": 5})
    torch.manual_seed(5)
    with smp.delay_param_initialization():
        model = _llama()
    model = smp.DistributedModel(model, backward_passes_per_step=passes)
    smp.set_activation_checkpointing(model.module.model.layers)
    runs = count_block_runs(model.module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    initial = {n: _full(p) for n, p in model.module.named_parameters()}
    losses = []
    for k in range(passes):
        ids = _batch(k).chunk(smp.dp_size())[smp.dp_rank()]  # prescaled_batch false: rows by dp rank
        losses.append(sum(smp.allgather(_train_step(model, ids).reduce_mean(), smp.DP_GROUP)).item() / smp.dp_size())
    grads = {n: _full(p.grad) for n, p in model.module.named_parameters()}
    opt.step()
    return {"initial": initial, "losses": losses, "grads": grads, "runs": runs,
            "weights": {n: _full(p) for n, p in model.module.named_parameters()}}


@pytest.mark.parametrize("world, layout, passes", [
    (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, 2),
    (4, {"pipeline_parallel_degree": 2}, 2),  # pipeline x data parallel 2: the average after the second pass
])
def test_accumulated_checkpointed_pipeline_from_delayed_init_steps_like_one_process(world, layout, passes):
    out = harness.run(world, accumulated_step, layout, passes)
    merged = _merged(out)
    torch.manual_seed(5)
    eager = dict(_llama().named_parameters())
    assert merged["initial"].keys() == eager.keys()
    for name, p in eager.items():  # HF's init, each tensor its own draw (at pp > 1 not eager's draws)
        got = merged["initial"][name]
        assert abs(got.std() - p.std()) <= 0.25 * p.std() + 1e-6 and abs(got.mean() - p.mean()) <= 0.1 + 1e-6, name
        assert p.std() == 0 or not any(torch.equal(got, merged["initial"][other]) for other in eager if other != name
                                       and merged["initial"][other].shape == got.shape), f"{name} repeated"
    ref = _llama()  # the plain model from the initialized values
    named = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(merged["initial"][name])
    batches = [_batch(k) for k in range(passes)]
    for k, ids in enumerate(batches):
        loss = ref(ids, labels=ids).loss
        loss.backward()  # accumulated: the passes' gradients add up
        got = out[0]["losses"][k]
        assert abs(got - loss.item()) <= tolerance(loss.detach()), (k, got, loss.item())
    noise = _fp32_gradient_noise(ref, lambda twin: sum(twin(ids, labels=ids).loss for ids in batches))
    for name, p in named.items():
        torch.testing.assert_close(merged["grads"][name], p.grad, rtol=0,
                                   atol=tolerance(p.grad) + NOISE_FACTOR * noise.get(name, 0.0),
                                   msg=lambda m, n=name: f"grad {n}: {m}")
    for r in out:  # each local block: a forward and a recompute for each microbatch of each pass
        assert r["runs"] and set(r["runs"].values()) == {2 * 2 * passes}, r["runs"]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for name, p in named.items():
        p.grad = merged["grads"][name].clone()
    opt.step()
    for name, p in named.items():
        _assert_equal(merged["weights"][name], p.detach(), f"weight {name} after the step")


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
