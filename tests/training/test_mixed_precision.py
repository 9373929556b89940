"""Mixed-precision training: fp16 (fp32 masters + dynamic loss scaling) and bf16 (fp32 masters)
against the fp32 run, on 2 ranks at TP degree 2.

A failure in the tracking test means half-precision training diverges from fp32 (NaN, or the
loss stalls: look at ``master_weights.py`` and ``DistributedOptimizer.step``); in the step test,
that the update is not fp32 AdamW applied to the fp32 masters with the unscaled gradients; in the
scale test, that the dynamic loss scale does not follow its documented rules.
"""

import math

import pytest
import torch

import harness
import modelparallel as smp

VOCAB, SEQ = 16, 16


def _gpt2():
    import transformers
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _batch(step: int) -> torch.Tensor:
    """Sequences whose next token is the previous one plus 1 or 3 (mod VOCAB), at random: the
    loss of a model that learned the rule is ln 2 per token, a floor that a half-precision run
    must reach as the fp32 run does (a run that stalls, or turns NaN, stays far above it)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (2, 1), generator=g)
    incr = 1 + 2 * torch.randint(0, 2, (2, SEQ - 1), generator=g)
    return torch.cat([start, start + incr.cumsum(1)], 1) % VOCAB


def _config(dtype: str, **extra) -> dict:
    return {"tensor_parallel_degree": 2, "fp16": dtype == "fp16", "bf16": dtype == "bf16", **extra}


def _setup(dtype: str, lr: float = 1e-2, **opt_kwargs):
    smp.init(_config(dtype))
    model = smp.DistributedModel(_gpt2())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=lr), **opt_kwargs)
    return model, opt


def _step(model, opt, step: int) -> float:
    ids = _batch(step)
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _scaling(dtype: str) -> dict:
    if dtype != "fp16":
        return {}
    return {"static_loss_scale": None, "dynamic_loss_scale": True,
            "dynamic_loss_args": {"init_scale": 2.0 ** 20, "scale_window": WINDOW}}


def _train(dtype: str, steps: int):
    model, opt = _setup(dtype, **_scaling(dtype))
    losses, scales, skipped = [], [], []
    for step in range(steps):
        losses.append(_step(model, opt, step))
        scales.append(opt.loss_scaler.loss_scale)
        skipped.append(opt.overflow)
    kinds = {p.dtype for p in model.parameters()}
    state_kinds = {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
    return losses, scales, skipped, sorted(map(str, kinds)), sorted(map(str, state_kinds))


STEPS, WINDOW = 80, 10
"""Long enough for the loss to fall from ~2.8 to its floor (ln 2 ~ 0.69, reached after ~50 steps)
and for the fp16 scale to grow several times (every WINDOW good steps)."""


_RUNS: dict[str, tuple] = {}


def _run(dtype: str) -> tuple:
    """Rank 0's record of a training run, each dtype trained once per session."""
    if dtype not in _RUNS:
        _RUNS[dtype] = harness.run(2, _train, dtype, STEPS)[0]
    return _RUNS[dtype]


@pytest.mark.parametrize("dtype, param_dtype", [("fp16", "torch.float16"), ("bf16", "torch.bfloat16")])
def test_half_precision_tracks_fp32(dtype, param_dtype):
    losses, _, skipped, kinds, state_kinds = _run(dtype)
    ref = _run("fp32")[0]
    assert all(math.isfinite(x) for x in losses)
    assert kinds == [param_dtype] and state_kinds == ["torch.float32"]
    # the mean of the last 20 losses (on the floor) within 3% of fp32's: rounding of
    # half-precision activations perturbs each step, and skipped fp16 steps (overflow) delay
    # the run by a few updates, which no longer matters once both are on the floor
    mine, theirs = sum(losses[-20:]) / 20, sum(ref[-20:]) / 20
    assert abs(mine - theirs) <= 0.03 * theirs, (dtype, mine, theirs, sum(skipped))
    assert theirs < 0.5 * ref[0]  # the fp32 run learned the rule, so tracking it means something


def test_fp16_loss_scale_follows_its_rules():
    _, scales, skipped, _, _ = _run("fp16")
    # init 2**20 overflows fp16 gradients at first: those steps are skipped and halve the scale
    assert skipped[0] and scales[0] == 2.0 ** 19
    window, run, prev = WINDOW, 0, 2.0 ** 20
    for scale, skip in zip(scales, skipped):
        if skip:
            assert scale == prev / 2, (scale, prev)
            run = 0
        else:
            run += 1
            assert scale == (prev * 2 if run == window else prev), (scale, prev, run)
            run = 0 if run == window else run
        prev = scale
    assert scales[-1] > min(scales)  # it grew again after the overflows


def _compute_dtypes(model, steps: int, autocast: torch.dtype | None = None):
    """Train ``steps`` steps; return the losses and the dtype the first block's attention
    weights and output had during the forward pass."""
    seen = {}
    attn = model.module.transformer.h[0].attn
    attn.register_forward_hook(lambda m, args, out: seen.update(weight=str(m.c_attn.weight.dtype),
                                                                 out=str(out[0].dtype)))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(steps):
        ids = _batch(step)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = sorted({str(p.dtype) for p in model.parameters()})
    return losses, seen, params, len(opt.master_weights)


def _fsdp_bf16(steps):
    smp.init({"tensor_parallel_degree": 1, "sharded_data_parallel_degree": 2, "bf16": True})
    return _compute_dtypes(smp.DistributedModel(_gpt2()), steps)


def _tp_autocast(steps):
    smp.init({"tensor_parallel_degree": 2})
    return _compute_dtypes(smp.DistributedModel(_gpt2()), steps, autocast=torch.bfloat16)


def test_bf16_under_fsdp_keeps_fp32_shards_and_computes_in_bf16():
    losses, seen, params, masters = harness.run(2, _fsdp_bf16, 30)[0]
    # FSDP's sharded parameters are the fp32 masters; blocks are gathered in bf16 for compute
    assert params == ["torch.float32"] and masters == 0
    assert seen == {"weight": "torch.bfloat16", "out": "torch.bfloat16"}
    assert all(math.isfinite(x) for x in losses) and sum(losses[-5:]) < 0.6 * sum(losses[:5])


def test_bf16_autocast_with_fp32_parameters_at_tp2():
    losses, seen, params, masters = harness.run(2, _tp_autocast, 30)[0]
    assert params == ["torch.float32"] and masters == 0
    assert seen == {"weight": "torch.float32", "out": "torch.bfloat16"}
    assert all(math.isfinite(x) for x in losses) and sum(losses[-5:]) < 0.6 * sum(losses[:5])
