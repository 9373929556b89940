"""fp32 master weights, ``clip_master_grads`` and the fp16 optimizer's state dict, on 2 ranks.

Each check compares with plain PyTorch on full tensors gathered from the ranks: a step must be
``torch.optim.AdamW`` applied to fp32 copies of the weights with the unscaled gradients, then
rounded to fp16; ``clip_master_grads`` must equal ``torch.nn.utils.clip_grad_norm_`` on those
fp32 copies. A failure in the resume test means a restored fp16 run does not continue exactly
as the uninterrupted one (look at ``optimizer_state.py``: the masters or the scaler's counters).
"""

import logging

import pytest
import torch
from torch.distributed.tensor import DTensor

import harness
import modelparallel as smp
from modelparallel.config import build_config
from test_mixed_precision import _batch, _gpt2

LR = 1e-2


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _setup(tp: int = 2, dtype: str = "fp16", **opt_kwargs):
    smp.init({"tensor_parallel_degree": tp, "fp16": dtype == "fp16", "bf16": dtype == "bf16"})
    model = smp.DistributedModel(_gpt2())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), **opt_kwargs)
    return model, opt


def _backward(model, step: int) -> float:
    ids = _batch(step)
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss.item()


# ---- multi-rank check functions ---------------------------------------------------------------

def _step_is_fp32_adamw_on_masters(dtype, scale):
    model, opt = _setup(dtype=dtype, static_loss_scale=scale)
    params = list(model.parameters())
    for step in range(2):  # the second step also checks that the masters, not the weights, carry on
        _backward(model, step)
        masters = [opt.master_weights.master_of(p) for p in params]
        assert all(m is not None and m.dtype == torch.float32 for m in masters)
        assert all(type(m) is type(p) and getattr(m, "placements", None) == getattr(p, "placements", None)
                   for m, p in zip(masters, params))
        ref = [torch.nn.Parameter(_full(m)) for m in masters]
        for r, p in zip(ref, params):
            r.grad = _full(p.grad).float() / scale
        ref_opt = torch.optim.AdamW(ref, lr=LR)
        if step:
            ref_opt.load_state_dict({"state": {i: {k: _full(v) for k, v in opt.state[p].items()}
                                               for i, p in enumerate(params)},
                                     "param_groups": ref_opt.state_dict()["param_groups"]})
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        for r, m, p in zip(ref, masters, params):
            # elementwise fp32 arithmetic on the same numbers: equal bit for bit
            assert torch.equal(_full(m), r.detach())
            assert p.dtype != torch.float32 and torch.equal(_full(p), r.detach().to(p.dtype))
            assert {v.dtype for k, v in opt.state[p].items() if k != "step"} == {torch.float32}
    return len(opt.master_weights)


def _clip_matches_single_process(tp, dtype, norm_type):
    scaling = {"static_loss_scale": 64.0} if dtype == "fp16" else {}
    model, opt = _setup(tp=tp, dtype=dtype, **scaling)
    scale = opt.loss_scaler.loss_scale
    _backward(model, 0)
    params = list(model.parameters())
    ref = [torch.nn.Parameter(_full(p).float()) for p in params]
    for r, p in zip(ref, params):
        r.grad = _full(p.grad).float() / scale
    ref_norm = torch.nn.utils.get_total_norm([r.grad for r in ref], norm_type)
    max_norm = ref_norm.item() / 4  # so that clipping happens
    torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    norm = opt.clip_master_grads(max_norm, norm_type)
    # fp32 sums of n positive terms: relative error below n * 2**-24 (worst case, any order)
    n = sum(r.numel() for r in ref)
    rtol = n * 2.0 ** -24
    torch.testing.assert_close(norm, ref_norm, rtol=rtol, atol=0)
    for r, (_, t) in zip(ref, opt.master_weights.params_and_masters()):
        torch.testing.assert_close(_full(t.grad), r.grad, rtol=rtol, atol=rtol * r.grad.abs().max().item())
    return norm.item()


def _save_resume(path, steps_before, steps_after):
    """Train, save (smp.save of the local state dicts), go on; then a fresh model and optimizer
    load the files and take the same steps. Returns both runs' losses and final weights."""
    kwargs = {"static_loss_scale": None, "dynamic_loss_scale": True,
              "dynamic_loss_args": {"init_scale": 2.0 ** 12, "scale_window": 2}}
    model, opt = _setup(**kwargs)
    for step in range(steps_before):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    smp.save({"model": model.local_state_dict(), "optimizer": opt.local_state_dict()}, path)
    smp.barrier()
    first = _continue(model, opt, steps_before, steps_after)

    model, opt = _setup(**{**kwargs, "dynamic_loss_args": {"scale_window": 2}})
    saved = smp.load(path)
    model.load_state_dict(saved["model"], same_partition_load=True)
    opt.load_state_dict(saved["optimizer"])
    second = _continue(model, opt, steps_before, steps_after)
    return first, second


def _continue(model, opt, start, steps):
    losses, scales = [], []
    for step in range(start, start + steps):
        losses.append(_backward(model, step))
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scaler.loss_scale)
    weights = {k: _full(v) for k, v in model.state_dict().items()}
    masters = [_full(m) for _, m in opt.master_weights.pairs]
    return losses, scales, weights, masters


def _resume_without_masters():
    model, opt = _setup()
    for step in range(2):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    sd.pop("fp32_from_fp16")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("modelparallel").addHandler(handler)
    try:
        fresh = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
        fresh.load_state_dict(sd)
        fresh.load_state_dict(sd)
    finally:
        logging.getLogger("modelparallel").removeHandler(handler)
    same = all(torch.equal(_full(m), _full(p).float()) for p, m in fresh.master_weights.pairs)
    return same, sum("recreated" in r.getMessage() for r in records)


def _refuses_optimizer(cls_name):
    smp.init({"tensor_parallel_degree": 2, "fp16": True})
    model = smp.DistributedModel(_gpt2())
    cls = getattr(torch.optim, cls_name)
    inner = cls(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=cls_name):
        smp.DistributedOptimizer(inner)
    return True


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, scale", [("fp16", 256.0), ("bf16", 1.0)])
def test_step_is_fp32_adamw_on_masters(dtype, scale):
    n = harness.run(2, _step_is_fp32_adamw_on_masters, dtype, scale)
    assert n[0] == n[1] > 0


@pytest.mark.parametrize("tp, dtype, norm_type", [
    (2, "fp16", 2.0),            # TP shards summed over the TP group, replicated ones counted once
    (2, "fp16", float("inf")),
    (2, "fp32", 2.0),            # no masters: clips the (unscaled) gradients themselves
    (1, "bf16", 2.0),            # two data-parallel replicas counted once
])
def test_clip_master_grads_equals_single_process(tp, dtype, norm_type):
    norms = harness.run(2, _clip_matches_single_process, tp, dtype, norm_type)
    assert norms[0] == norms[1]


def test_fp16_save_resume_continues_bit_exactly(tmp_path):
    for first, second in harness.run(2, _save_resume, str(tmp_path / "ckpt"), 3, 4):
        assert first[0] == second[0] and first[1] == second[1]  # losses and loss scales
        assert first[2].keys() == second[2].keys()
        assert all(torch.equal(first[2][k], second[2][k]) for k in first[2])
        assert all(torch.equal(a, b) for a, b in zip(first[3], second[3]))


def test_resume_without_masters_recreates_them_and_says_so_once():
    assert harness.run(2, _resume_without_masters) == [(True, 1), (True, 1)]


@pytest.mark.parametrize("cls_name", ["LBFGS", "SparseAdam"])
def test_optimizer_without_fp32_master_form_is_refused(cls_name):
    assert harness.run(2, _refuses_optimizer, cls_name) == [True, True]


def test_fp16_and_bf16_together_refused():
    with pytest.raises(ValueError, match="fp16 and bf16"):
        build_config({"fp16": True, "bf16": True}, world_size=1)


def _full_export(path):
    """fp16 training, then full checkpoints in the training dtype and in fp32; rank 0 loads each
    with ``from_pretrained`` and compares with the gathered parameters / fp32 masters."""
    import transformers
    model, opt = _setup(static_loss_scale=256.0)
    for step in range(2):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    params = {n: _full(p) for n, p in model.module.named_parameters()}
    masters = {n: _full(opt.master_weights.master_of(p)) for n, p in model.module.named_parameters()}
    smp.save_checkpoint(path, tag="half", partial=False)
    smp.save_checkpoint(path, tag="fp32", partial=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="full checkpoints"):
        smp.save_checkpoint(path, tag="p", dtype=torch.float32)
    with pytest.raises(ValueError, match="int8"):
        smp.save_checkpoint(path, tag="x", partial=False, dtype=torch.int8)
    if smp.rank() != 0:
        return None
    out = {}
    for tag, want, dtype in (("half", params, torch.float16), ("fp32", masters, torch.float32)):
        loaded = transformers.GPT2LMHeadModel.from_pretrained(f"{path}/{tag}", dtype="auto")
        got = dict(loaded.named_parameters())
        assert got.keys() == want.keys()
        bad = [n for n in want if got[n].dtype != dtype or not torch.equal(got[n].detach(), want[n].reshape(got[n].shape))]
        out[tag] = bad
    return out


def test_full_checkpoint_exports_training_dtype_or_fp32_masters(tmp_path):
    assert harness.run(2, _full_export, str(tmp_path / "ckpt"))[0] == {"half": [], "fp32": []}


def _partial_checkpoint_resume(path):
    """fp16 training saved with smp.save_checkpoint at step 3 and resumed by a fresh model and
    optimizer through smp.resume_from_checkpoint: the next steps equal the uninterrupted run's."""
    kwargs = {"static_loss_scale": None, "dynamic_loss_scale": True,
              "dynamic_loss_args": {"init_scale": 2.0 ** 12, "scale_window": 2}}
    model, opt = _setup(**kwargs)
    for step in range(3):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    smp.save_checkpoint(path, tag="step3", user_content={"step": 3})
    first = _continue(model, opt, 3, 4)
    model, opt = _setup(**{**kwargs, "dynamic_loss_args": {"scale_window": 2}})
    assert smp.resume_from_checkpoint(path) == {"step": 3}
    second = _continue(model, opt, 3, 4)
    return first, second


def _fp32_checkpoint_resumed_in_fp16(path):
    """A checkpoint saved by an fp32 run has no masters: resumed in fp16 they are read from its
    model part's fp32 weights (what the run stepped), not recreated from the rounded fp16 ones,
    and nothing is said about recreating them."""
    model, opt = _setup(dtype="fp32")
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    smp.save_checkpoint(path, tag="fp32run")
    weights = {n: _full(p) for n, p in model.module.named_parameters()}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("modelparallel").addHandler(handler)
    try:
        model, opt = _setup(dtype="fp16")
        smp.resume_from_checkpoint(path)
    finally:
        logging.getLogger("modelparallel").removeHandler(handler)
    names = {id(p): n for n, p in model.module.named_parameters()}
    # masters = the saved fp32 weights exactly (the fp16 weights are them rounded)
    ok = all(torch.equal(_full(m), weights[names[id(p)]]) and torch.equal(_full(p), weights[names[id(p)]].half())
             for p, m in opt.master_weights.pairs)
    return ok, sum("recreated" in r.getMessage() for r in records)


def test_fp16_partial_checkpoint_resume_continues_bit_exactly(tmp_path):
    for first, second in harness.run(2, _partial_checkpoint_resume, str(tmp_path / "ckpt")):
        assert first[0] == second[0] and first[1] == second[1]  # losses and loss scales
        assert all(torch.equal(first[2][k], second[2][k]) for k in first[2])
        assert all(torch.equal(a, b) for a, b in zip(first[3], second[3]))


def test_checkpoint_without_masters_resumed_in_fp16_takes_them_from_the_fp32_weights(tmp_path):
    assert harness.run(2, _fp32_checkpoint_resumed_in_fp16, str(tmp_path / "ckpt")) == [(True, 0), (True, 0)]
