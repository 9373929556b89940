"""``DistributedOptimizer`` over a pipelined model: clipping by the norm of the whole model
(every stage counted once, a weight tied across stages once), and fp16 / bf16 training with
fp32 masters and loss scaling whose overflow skips agree on every stage.

A clipping failure means the global norm counts a stage's gradients on the wrong number of ranks
or counts GPT-2's tied ``wte`` / ``lm_head`` twice (modelparallel/training/grad_clip.py's
``holders``, pipeline/ties.py's ``norm_holders``; for ``smp.clip_grad_norm_(model, ...)``, the
module form in modelparallel/clip.py); a mixed-precision failure that half-precision
training at pipeline degree 2 diverges from fp32 or that stages disagree on skipping a step.
"""

import copy
import math

import pytest
import torch

import harness
import modelparallel as smp
from reference import as_hf
from test_pipeline_training import build, global_batch, my_rows, train_step


def _clip(pp, tp, norm_type, how):
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2, "random_seed": 1})
    torch.manual_seed(1)
    ref = build("gpt2")
    model = smp.DistributedModel(copy.deepcopy(ref))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids = global_batch(0)
    ref(ids, labels=ids).loss.backward()
    train_step(model, my_rows(ids))
    grads = [p.grad for p in ref.parameters()]  # the tied weight once
    want = torch.nn.utils.get_total_norm(grads, norm_type)
    max_norm = want.item() / 4
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm, norm_type)
    if how == "optimizer":
        norm = opt.clip_master_grads(max_norm, norm_type)
    elif how == "module":  # SageMaker v2's form: the model itself
        norm = smp.clip_grad_norm_(model, max_norm, norm_type)
    else:
        norm = smp.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    rtol = sum(g.numel() for g in grads) * 2.0 ** -24  # fp32 sums of that many positive terms
    torch.testing.assert_close(norm, want, rtol=rtol, atol=0)
    named = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.module.named_parameters():
        expected = named[name].grad
        torch.testing.assert_close(as_hf(p.grad, expected), expected, rtol=rtol, atol=rtol * expected.abs().max().item(),
                                   msg=lambda m, n=name: f"clipped grad {n}: {m}")
    return norm.item()


@pytest.mark.parametrize("world, pp, tp, norm_type, how", [
    (2, 2, 1, 2.0, "optimizer"),
    (2, 2, 1, math.inf, "optimizer"),
    (4, 2, 2, 2.0, "optimizer"),
    (4, 4, 1, 2.0, "smp"),
    (4, 2, 1, 2.0, "smp"),
    (2, 2, 1, 2.0, "module"),
    (4, 2, 2, 2.0, "module"),
])
def test_clipping_counts_every_stage_once(world, pp, tp, norm_type, how):
    norms = harness.run(world, _clip, pp, tp, norm_type, how)
    assert len(set(norms)) == 1, norms


def _rule_batch(step: int) -> torch.Tensor:
    """Sequences whose next token is the previous plus 1 or 3 (mod 16), at random: a model
    that learned the rule has loss ln 2 per token, a floor a half-precision run must reach."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 16, (4, 1), generator=g)
    incr = 1 + 2 * torch.randint(0, 2, (4, 15), generator=g)
    return torch.cat([start, start + incr.cumsum(1)], 1) % 16


def _mixed(dtype, steps):
    from transformers import GPT2Config, GPT2LMHeadModel

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "fp16": dtype == "fp16", "bf16": dtype == "bf16"})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=16,
                                                            n_positions=16, resid_pdrop=0, embd_pdrop=0,
                                                            attn_pdrop=0, bos_token_id=0, eos_token_id=0)))
    scaling = {"static_loss_scale": None, "dynamic_loss_scale": True,
               "dynamic_loss_args": {"init_scale": 2.0 ** 20, "scale_window": 10}} if dtype == "fp16" else {}
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **scaling)
    losses, skipped = [], []
    for step in range(steps):
        losses.append(train_step(model, _rule_batch(step)).reduce_mean().item())
        opt.step()
        opt.zero_grad()
        skipped.append(opt.overflow)
    kinds = sorted({str(p.dtype) for p in model.parameters()})
    return losses, skipped, kinds, opt.loss_scaler.loss_scale


STEPS = 100
"""Long enough for the loss to reach its floor (ln 2) in fp32, fp16 (after its first skipped steps)
and bf16."""


def test_half_precision_tracks_fp32_at_pipeline_degree_2():
    runs = {dtype: harness.run(2, _mixed, dtype, STEPS) for dtype in ("fp32", "fp16", "bf16")}
    ref = runs["fp32"][0][0]
    assert ref[-1] < 0.5 * ref[0], "the fp32 run learned the rule"
    for dtype, want in (("fp16", "torch.float16"), ("bf16", "torch.bfloat16")):
        ranks = runs[dtype]
        losses, skipped, kinds, scale = ranks[0]
        assert all(r[1] == skipped and r[3] == scale for r in ranks), "every stage skips the same steps"
        assert all(r[2] == [want] for r in ranks)
        assert all(math.isfinite(x) for x in losses)
        mine, theirs = sum(losses[-20:]) / 20, sum(ref[-20:]) / 20
        assert abs(mine - theirs) <= 0.03 * theirs, (dtype, mine, theirs, sum(skipped))
    assert runs["fp16"][0][1][0], "init scale 2**20 overflows fp16 at first: the step is skipped everywhere"
