"""torch's optimizers at every setting (for-loop, ``foreach``, ``fused``) on parallelized models.

Each case trains a parallelized model and the single-process Hugging Face model with the same
optimizer setting for a few steps, every rank on the same batch (so data-parallel averaging gives
that batch's gradient). Every step the losses and gradients must agree up to reordered rounding
(``reference.tolerance``); then the reference takes the distributed model's (gathered) gradients,
both optimizers step, and every parameter must be bitwise equal to the reference's: these
optimizers update each element on its own, so sharding changes nothing in their arithmetic.

A failure at ``step()`` ("mixed torch.Tensor and DTensor") means a parameter was left a plain
tensor beside DTensors (modelparallel/tp/dtensor_params.py, called from parallelize.py); a
parameter that differs after the step, that the optimizer saw another gradient or state (the
fp32 masters of training/master_weights.py, or a parameter missing from the optimizer).
"""

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from reference import as_hf, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parent / "expert"))
from moe_reference import mixtral_config  # noqa: E402 - the expert tests' tiny Mixtral

STEPS = 3
SETTINGS = [
    ("AdamW", {}), ("AdamW", {"foreach": True}), ("AdamW", {"foreach": False}), ("AdamW", {"fused": True}),
    ("SGD", {"momentum": 0.9}), ("SGD", {"momentum": 0.9, "foreach": True}),
    ("SGD", {"momentum": 0.9, "foreach": False}), ("Adam", {"fused": True}),
]
LR = {"AdamW": 1e-2, "Adam": 1e-2, "SGD": 1e-1}


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        max_position_embeddings=16))


def _mixtral():
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM(mixtral_config())


MODELS = {"gpt2": _gpt2, "llama": _llama, "mixtral": _mixtral}


def _batch(step: int) -> torch.Tensor:
    return torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(10 + step))


@smp.step
def _v1_step(model, ids):
    out = model(ids, labels=ids)
    model.backward(out.loss)
    return out.loss


def _v1(config, arch, name, kwargs):
    """A DistributedModel and its DistributedOptimizer; ``(model, optimizer, module, forward_backward)``."""
    smp.init(config)
    torch.manual_seed(0)
    model = smp.DistributedModel(MODELS[arch]())
    opt = smp.DistributedOptimizer(getattr(torch.optim, name)(model.parameters(), lr=LR[name], **kwargs))
    # under context parallelism each rank brings its part of every sequence
    parts = smp.get_batch_for_cp_rank if smp.cp_size() > 1 else (lambda ids: ids)
    return model, opt, model.module, lambda ids: _v1_step(model, parts(ids)).reduce_mean()


def _v2_fsdp2(config, arch, name, kwargs):
    """``transform`` then FSDP2 over "dp", as SageMaker v2 scripts do, and a plain optimizer."""
    from torch.distributed.fsdp import fully_shard

    smp.init(config)
    torch.manual_seed(0)
    model = smp.transform(MODELS[arch]())
    for layer in model.model.layers:
        fully_shard(layer, mesh=smp.dp_mesh())
    fully_shard(model, mesh=smp.dp_mesh())
    opt = getattr(torch.optim, name)(model.parameters(), lr=LR[name], **kwargs)

    def forward_backward(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss
    return model, opt, model, forward_backward


def _stepped(opt, p):
    """What the optimizer steps for model parameter ``p``: its fp32 master, or ``p`` itself."""
    master = opt.master_weights.master_of(p) if isinstance(opt, smp.DistributedOptimizer) else None
    return p if master is None else master


def _compare_step(ref, module, opt, ref_opt, loss, ids, compare_grads):
    """Losses and gradients within rounding; then the same gradients into both, a step of each,
    and bitwise-equal parameters. Returns the number of parameters compared."""
    want_loss = ref(ids, labels=ids).loss
    want_loss.backward()
    named = dict(ref.named_parameters(remove_duplicate=False))
    mine = list(module.named_parameters())
    if compare_grads:  # every rank brings the same rows: their mean (context ranks: of their shares) is the loss
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=smp.runtime.current().group(smp.runtime.DP_CP_GROUP))
        loss /= smp.rdp_size() * smp.cp_size()
        torch.testing.assert_close(loss.float(), want_loss.detach(), rtol=0, atol=tolerance(want_loss))
        atol = max(tolerance(p.grad) for p in ref.parameters() if p.grad is not None)  # near-zero sums: model scale
        for name, p in mine:
            torch.testing.assert_close(as_hf(p.grad, named[name].grad).float(), named[name].grad, rtol=0, atol=atol,
                                       msg=lambda m, n=name: f"grad {n}: {m}")
    for name, p in mine:
        named[name].grad = as_hf(p.grad, named[name].grad).to(named[name].dtype).clone()
    opt.step()
    ref_opt.step()
    for name, p in mine:
        got = as_hf(_stepped(opt, p).detach(), named[name])
        assert got.dtype == named[name].dtype and torch.equal(got, named[name].detach()), \
            f"{name}: max difference {(got.double() - named[name].double()).abs().max().item()} after the step"
        if p.dtype != named[name].dtype:  # a half-precision parameter holds its master rounded
            assert torch.equal(as_hf(p.detach(), named[name]), named[name].detach().to(p.dtype)), name
    opt.zero_grad()
    ref_opt.zero_grad()
    return len(mine)


def check_settings(build, config, arch, dtype=None, compare_later_grads=True):
    """Every optimizer setting of SETTINGS on a model built by ``build(config, arch, name, kwargs)``
    against the single-process model: STEPS steps each. Returns the number of parameters compared."""
    compared = 0
    for name, kwargs in SETTINGS:
        model, opt, module, forward_backward = build(config, arch, name, kwargs)
        torch.manual_seed(0)
        ref = MODELS[arch]()
        if dtype is not None:  # the masters start as the half-precision weights, exactly
            ref = ref.to(dtype).float()
        ref_opt = getattr(torch.optim, name)(ref.parameters(), lr=LR[name], **kwargs)
        for step in range(STEPS):
            ids = _batch(step)
            loss = forward_backward(ids)
            compare = dtype is None and (step == 0 or compare_later_grads)
            try:
                compared += _compare_step(ref, module, opt, ref_opt, loss, ids, compare)
            except AssertionError as e:
                raise AssertionError(f"{name}({kwargs}) step {step}: {e}") from None
    return compared


CASES = {
    "tp1": (1, _v1, {"tensor_parallel_degree": 1}, "gpt2"),
    "tp2": (2, _v1, {"tensor_parallel_degree": 2, "prescaled_batch": True}, "gpt2"),
    "tp2_sequence_parallel": (2, _v1, {"tensor_parallel_degree": 2, "prescaled_batch": True,
                                       "sequence_parallel": True}, "llama"),
    "cp2": (2, _v1, {"context_parallel_degree": 2}, "llama"),
    "ep2": (2, _v1, {"expert_parallel_degree": 2}, "mixtral"),
    "fsdp2_over_transform_tp2": (4, _v2_fsdp2, {"tensor_parallel_degree": 2, "prescaled_batch": True}, "llama"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_setting_steps_like_one_process(case):
    world, build, config, arch = CASES[case]
    assert min(harness.run(world, check_settings, build, config, arch)) > 0


def test_pipeline_stages_step_like_one_process():
    """Each stage's parameters (the other stage's reference parameters step on the reference's own
    gradients, so only the first step's gradients are compared)."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 2}
    assert min(harness.run(2, check_settings, _v1, config, "gpt2", compare_later_grads=False)) > 0


def test_bf16_masters_step_like_one_process():
    """bf16 parameters with fp32 masters: the masters step exactly as an fp32 model started from
    the bf16 weights and given the bf16 gradients."""
    config = {"tensor_parallel_degree": 2, "prescaled_batch": True, "bf16": True}
    assert min(harness.run(2, check_settings, _v1, config, "gpt2", dtype=torch.bfloat16)) > 0


def fused_sgd_refused():
    smp.init({"tensor_parallel_degree": 2})
    model = smp.DistributedModel(_gpt2())
    with pytest.raises(NotImplementedError, match=r"SGD\(fused=True\).*_fused_sgd_.*foreach=True"):
        smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, fused=True))
    assert not smp.runtime.current().optimizers, "nothing registered"
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_fused_sgd_is_refused_by_name():
    """torch 2.13's DTensor has no rule for SGD's fused kernel: refused when wrapped, not at the
    first step."""
    harness.run(2, fused_sgd_refused)


def fsdp1_losses(name, kwargs):
    """FSDP1 over ``transform`` (flat parameters, plain tensors to the optimizer): losses only."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from reference import training_rtol

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    torch.manual_seed(0)
    ref = _llama()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(smp.transform(copy.deepcopy(ref)), auto_wrap_policy=policy, device_id=torch.device("cpu"),
                 device_mesh=smp.dp_mesh(), use_orig_params=True)
    opts = [getattr(torch.optim, name)(m.parameters(), lr=LR[name], **kwargs) for m in (model, ref)]
    for step in range(STEPS):
        ids = _batch(step)
        losses = [m(ids, labels=ids).loss for m in (model, ref)]
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
        rel = abs(losses[0].item() - losses[1].item()) / losses[1].item()
        assert rel < training_rtol(step), f"{name}({kwargs}) step {step}: {losses[0].item()} vs {losses[1].item()}"


@pytest.mark.parametrize("name, kwargs", [("AdamW", {"foreach": True}), ("AdamW", {"fused": True}),
                                          ("SGD", {"momentum": 0.9, "foreach": True})])
def test_fsdp1_over_transform(name, kwargs):
    harness.run(4, fsdp1_losses, name, kwargs)
