"""DistributedOptimizer and the loss scalers, checked against independently computed references.

Training steps are compared with plain ``torch.optim.AdamW`` on an unwrapped single-process copy
of the model; loss-scale trajectories with values worked out by hand from the documented rules.
Multi-rank checks run on the harness's 2-rank pool (TP degree 2). The scalers' rules alone, with
no optimizer, are in tests/training/test_loss_scaler.py.
"""

import copy
import io

import pytest
import torch
from torch.distributed.tensor import DTensor

import harness
import modelparallel as smp
from modelparallel import runtime
from modelparallel.training.dp import local_grad
from reference import tolerance

LR, EPS, STEPS = 1e-4, 1e-2, 3
"""Small lr, eps well above the default 1e-8. Adam's update is about lr * g / (|g| + eps): for
gradients near zero it turns a rounding difference d between the sharded and the single-process
gradient (another summation order) into at most lr * d / eps per step, so after STEPS steps the
parameters may differ by STEPS * lr / eps times the gradient tolerance (plus their own rounding),
while every parameter with a gradient comparable to eps moves by about STEPS * lr / 2."""


def _gpt2():
    import transformers
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + step))


def _setup(**opt_kwargs):
    """init TP 2, wrap a tiny GPT-2, and build AdamW + DistributedOptimizer; also return an
    unwrapped copy taken before wrapping (the reference)."""
    smp.init({"tensor_parallel_degree": 2})
    model = _gpt2()
    ref = copy.deepcopy(model)
    dm = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(dm.parameters(), lr=LR, eps=EPS), **opt_kwargs)
    return dm, opt, ref


def _train_step(dm, opt, step: int, poison: bool = False) -> None:
    """One step; with ``poison`` rank 1 alone puts an inf in one element of a sharded gradient."""
    opt.zero_grad()
    ids = _batch(step)
    dm.backward(dm(input_ids=ids, labels=ids).loss)
    if poison and smp.rank() == 1:
        local_grad(dm.module.transformer.h[0].mlp.c_fc.weight).view(-1)[7] = float("inf")
    opt.step()


def _local_params(dm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in dm.local_state_dict().items()}


def _assert_same(name, got, want, rtol, atol) -> None:
    full = got.full_tensor() if isinstance(got, DTensor) else got
    # packed c_attn is stored [in, 3, out/3] (bias [3, out/3]); HF's [in, out] is its reshape
    torch.testing.assert_close(full.detach().reshape(want.shape), want.detach(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")


def _assert_same_param(name, got, want) -> None:
    """Parameters after STEPS AdamW steps: see LR, EPS for the bound."""
    atol = STEPS * LR / EPS * tolerance(want.grad) + tolerance(want)
    _assert_same(name, got, want, rtol=0, atol=atol)


# ---- multi-rank check functions (module level so the pool can run them) --------------------------

def _matches_plain_adamw(opt_kwargs):
    dm, opt, ref = _setup(**opt_kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        _train_step(dm, opt, step)
        ref_opt.zero_grad()
        ids = _batch(step)
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
    got = dict(dm.module.named_parameters())
    for name, want in ref.named_parameters():
        _assert_same_param(name, got[name], want)
        # Adam is nearly blind to a constant gradient factor, so the unscaling is checked on the
        # gradients themselves, which step() divides by the loss scale in place. After two steps
        # the two models differ by rounding, and sums that nearly cancel amplify it: tolerance
        # relative to the tensor's largest gradient (a missed unscale is off by a factor >= 128).
        _assert_same(name + ".grad", got[name].grad, want.grad, rtol=1e-4,
                     atol=1e-4 * want.grad.abs().max().item())
    assert not opt.overflow
    return opt.loss_scaler.loss_scale


def _overflow_trajectory(delayed_shift):
    """Two poisoned steps then a clean one; report scales, skips, whether parameters stayed put
    and whether AdamW has taken a step (it keeps no state before its first one)."""
    dm, opt, _ = _setup(dynamic_loss_scale=True,
                        dynamic_loss_args={"init_scale": 2.0 ** 10, "delayed_shift": delayed_shift})
    scales, skipped, unchanged, stepped = [], [], [], []
    for step, poison in enumerate((True, True, False)):
        before = _local_params(dm)
        _train_step(dm, opt, step, poison=poison)
        after = dm.local_state_dict()
        scales.append(opt.loss_scaler.loss_scale)
        skipped.append(opt.overflow)
        unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
        stepped.append(len(opt.state) > 0)
    return scales, skipped, unchanged, stepped


def _growth_trajectory():
    dm, opt, _ = _setup(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 16.0, "scale_window": 2})
    scales = []
    for step, poison in enumerate((False, False, False, True, False, False)):
        _train_step(dm, opt, step, poison=poison)
        scales.append(opt.loss_scaler.loss_scale)
    return scales


def _state_dict_round_trip():
    dm, opt, _ = _setup(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 64.0, "scale_window": 2})
    for step in range(STEPS):
        _train_step(dm, opt, step)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved_scale = opt.loss_scaler.loss_scale
    saved_avg = {id(p): opt.state[p]["exp_avg"].to_local().clone() for p in dm.parameters()
                 if isinstance(p, DTensor)}

    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh = smp.DistributedOptimizer(torch.optim.AdamW(dm.parameters(), lr=LR), dynamic_loss_scale=True,
                                     dynamic_loss_args={"scale_window": 2})
    assert fresh.loss_scaler.loss_scale == 2.0 ** 32
    fresh.load_state_dict(loaded)
    assert fresh.loss_scaler.loss_scale == saved_scale
    assert fresh.loss_scaler.good_steps == opt.loss_scaler.good_steps
    for p in dm.parameters():
        if id(p) in saved_avg:
            assert torch.equal(fresh.state[p]["exp_avg"].to_local(), saved_avg[id(p)])
    assert all(fresh.state[p]["step"] == 3 for p in dm.parameters())
    return saved_scale, len(saved_avg)


def _misuse():
    smp.init({"tensor_parallel_degree": 2})
    model = _gpt2()
    early = torch.optim.AdamW(model.parameters(), lr=LR)
    dm = smp.DistributedModel(model)
    with pytest.raises(ValueError, match=r"must be created after smp\.DistributedModel\(\.\.\.\)"):
        smp.DistributedOptimizer(early)

    extra = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    mixed = torch.optim.AdamW([*dm.parameters(), *extra], lr=LR)
    with pytest.raises(ValueError, match=r"^2 of the optimizer's"):
        smp.DistributedOptimizer(mixed)

    good = torch.optim.AdamW(dm.parameters(), lr=LR)
    with pytest.raises(ValueError, match="init_scal"):
        smp.DistributedOptimizer(good, dynamic_loss_scale=True, dynamic_loss_args={"init_scal": 8.0})
    assert runtime.current().optimizers == []  # failed constructions registered nothing

    opt = smp.DistributedOptimizer(good)
    with pytest.raises(ValueError, match="must be created after"):
        opt.add_param_group({"params": extra})
    assert runtime.current().optimizers == [opt]
    return True


def _own_optimizer_scales_own_model():
    """Two models, each with its optimizer: a model's backward applies its own optimizer's loss
    scale, not the newest optimizer's."""
    smp.init({"tensor_parallel_degree": 2})
    a, b = smp.DistributedModel(_gpt2()), smp.DistributedModel(_gpt2())
    opt_a = smp.DistributedOptimizer(torch.optim.AdamW(a.parameters(), lr=LR), static_loss_scale=8.0)
    opt_b = smp.DistributedOptimizer(torch.optim.AdamW(b.parameters(), lr=LR), static_loss_scale=2.0)
    ids = _batch(0)
    a(input_ids=ids, labels=ids).loss.backward()  # plain autograd: the unscaled gradients
    plain = [local_grad(p).clone() for p in a.parameters()]
    a.zero_grad()
    a.backward(a(input_ids=ids, labels=ids).loss)
    # a power-of-two scale is exact in floating point, so scaled gradients are exactly 8x
    exact = all(torch.equal(local_grad(p), 8.0 * g) for p, g in zip(a.parameters(), plain))
    links = (opt_a.models == [a], opt_b.models == [b], a.linked_optimizers == (opt_a,),
             smp.state.optimizer is opt_b, smp.state.model is b)
    return exact, links


def _lr_scheduler_accepts_wrapper():
    dm, opt, _ = _setup()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    _train_step(dm, opt, 0)
    sched.step()
    return opt.param_groups[0]["lr"]


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("opt_kwargs, final_scale", [
    ({}, 1.0),
    ({"static_loss_scale": 128.0}, 128.0),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0 ** 10}}, 2.0 ** 10),
], ids=["static1", "static128", "dynamic"])
def test_steps_match_plain_adamw(opt_kwargs, final_scale):
    # power-of-two scales are exact in fp32, so scaled training must equal unscaled training
    assert harness.run(2, _matches_plain_adamw, opt_kwargs) == [final_scale] * 2


@pytest.mark.parametrize("delayed_shift, want_scales", [
    (1, [2.0 ** 9, 2.0 ** 8, 2.0 ** 8]),   # every overflow halves
    (2, [2.0 ** 10, 2.0 ** 9, 2.0 ** 9]),  # first overflow absorbed by hysteresis, second halves
])
def test_overflow_on_one_rank_skips_on_all(delayed_shift, want_scales):
    for scales, skipped, unchanged, stepped in harness.run(2, _overflow_trajectory, delayed_shift):
        assert scales == want_scales
        assert skipped == [True, True, False]
        assert unchanged == [True, True, False]
        assert stepped == [False, False, True]


def test_scale_grows_after_scale_window_good_steps():
    # window 2 from 16: good, good -> 32; good; overflow -> 16 (run restarts); good, good -> 32
    assert harness.run(2, _growth_trajectory) == [[16.0, 32.0, 32.0, 16.0, 16.0, 32.0]] * 2


def test_state_dict_round_trip():
    # init 64, window 2, three good steps -> 128 with one good step pending
    for scale, sharded in harness.run(2, _state_dict_round_trip):
        assert scale == 128.0 and sharded > 0


def test_misuse_raises_and_registers_nothing():
    assert harness.run(2, _misuse) == [True, True]


def test_each_model_uses_its_own_optimizers_loss_scale():
    for exact, links in harness.run(2, _own_optimizer_scales_own_model):
        assert exact, "model.backward did not scale by its own optimizer's loss scale"
        assert all(links), links


def test_lr_scheduler_accepts_wrapper():
    assert harness.run(2, _lr_scheduler_accepts_wrapper) == [LR * 0.5] * 2


def test_requires_init(monkeypatch):
    monkeypatch.setattr(runtime, "_RUNTIME", None)
    with pytest.raises(RuntimeError, match="init"):
        smp.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
