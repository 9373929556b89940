"""GPT-2 under tensor parallelism equals single-process Hugging Face GPT-2.

A failure here means the GPT-2 plan (modelparallel/models/gpt2.py), a style
(modelparallel/tp/styles.py) or the vocab-parallel loss (modelparallel/tp/loss.py) computes
something else than HF does. Look first at which quantity differs: logits -> styles/plan; loss
only -> tp/loss.py; gradients only -> the backward of a style or of the loss.
"""

import dataclasses

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model

import harness
import modelparallel as smp
from modelparallel.models import architecture_for
from modelparallel.tp.plan import Packed
from modelparallel.tp.walker import collect
from reference import (all_reduces, assert_close, assert_grads_match, assert_same_training, build_pair,
                       comm_counts_by_kind, gathered)

REAL_VOCAB = 50257  # not divisible by 2 or 4: shards are uneven, shapes must stay HF's


def tiny(vocab=REAL_VOCAB, layers=2, **kw):
    return GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=vocab, n_positions=32, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, **kw)


def _batch(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    return ids, mask


def check_lm_numerics(tp):
    ref, model = build_pair(GPT2LMHeadModel, tiny(), tp)
    ids, mask = _batch(REAL_VOCAB)
    labels = ids.masked_fill(mask == 0, -100)
    want = ref(ids, attention_mask=mask, labels=labels)
    got = model(ids, attention_mask=mask, labels=labels)
    assert got.logits.shape == want.logits.shape == (2, 12, REAL_VOCAB)
    assert_close(got.logits, want.logits, what="logits")
    assert_close(got.loss, want.loss, what="loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model, rerun=lambda m: m(ids, attention_mask=mask, labels=labels).loss)
    assert model.module.lm_head.weight is model.module.transformer.wte.weight, "LM head untied from wte"
    plain = model(ids, attention_mask=mask).logits
    assert type(plain) is torch.Tensor, "inference logits must be a plain tensor"
    assert_close(plain, want.logits)


def check_training_steps(tp, steps=10):
    ref, model = build_pair(GPT2LMHeadModel, tiny(vocab=1000), tp)
    batches = [_batch(1000, seed=100 + step)[0] for step in range(steps)]
    assert_same_training(ref, model, [dict(input_ids=ids, labels=ids) for ids in batches])


def check_generate(tp):
    ref, model = build_pair(GPT2LMHeadModel, tiny(), tp)
    ids, _ = _batch(REAL_VOCAB)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids[:, :5]))
    assert torch.equal(model.generate(ids[:, :5], **kw), ref.generate(ids[:, :5], **kw))


def check_base_and_classifier(tp):
    for cls in (GPT2Model, GPT2ForSequenceClassification):
        ref, model = build_pair(cls, tiny(vocab=500), tp)
        ids, mask = _batch(500)
        kwargs = dict(attention_mask=mask)
        if cls is GPT2ForSequenceClassification:
            kwargs["labels"] = torch.tensor([0, 1])
        want, got = ref(**kwargs, input_ids=ids), model(**kwargs, input_ids=ids)
        key = "last_hidden_state" if cls is GPT2Model else "logits"
        assert_close(got[key], want[key], what=f"{cls.__name__} {key}")
        # a plain .sum() of the final LayerNorm's output has a zero gradient in exact arithmetic
        # (normalized features sum to a constant), so its gradients would be pure rounding noise:
        # weight the outputs with a fixed random probe instead
        probe = torch.randn(want[key].shape, generator=torch.Generator().manual_seed(7))
        def scalar(out):
            return gathered(out[key]).mul(probe).sum() if cls is GPT2Model else out.loss
        scalar(want).backward()
        model.backward(scalar(got))
        assert_grads_match(ref, model, rerun=lambda m: scalar(m(**kwargs, input_ids=ids)))


def check_packed_qkv_shards(tp):
    """Each rank holds its own heads of q, k and v: never a contiguous chunk of the fused c_attn."""
    ref, model = build_pair(GPT2LMHeadModel, tiny(vocab=100), tp)
    e, r = 64, smp.tp_rank()
    hf = ref.transformer.h[0].attn.c_attn.weight  # [in, 3 * e]: q | k | v
    cols = torch.cat([torch.arange(c * e + r * e // tp, c * e + (r + 1) * e // tp) for c in range(3)])
    local = model.module.transformer.h[0].attn.c_attn.weight.to_local().flatten(1)
    assert torch.equal(local, hf[:, cols])
    assert model.module.transformer.h[0].attn.num_heads == 4 // tp


def collective_counts(layers):
    """All-reduce counts of one forward and one backward, per phase; gathers by kind."""
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})  # same batch on TP ranks
    model = smp.DistributedModel(GPT2LMHeadModel(tiny(vocab=1000, layers=layers)))
    ids, _ = _batch(1000)
    with CommDebugMode() as fwd:
        loss = model(ids, labels=ids).loss
    with CommDebugMode() as bwd:
        loss.backward()
    return comm_counts_by_kind(fwd), comm_counts_by_kind(bwd)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_lm_logits_loss_grads(tp):
    harness.run(tp, check_lm_numerics, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ten_adamw_steps(tp):
    harness.run(tp, check_training_steps, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_generate_greedy_tokens(tp):
    harness.run(tp, check_generate, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_base_model_and_sequence_classification(tp):
    harness.run(tp, check_base_and_classifier, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_qkv_sharded_per_head(tp):
    harness.run(tp, check_packed_qkv_shards, tp)


def test_two_allreduces_per_layer_each_way_and_no_logit_gather():
    (f2, b2), (f3, b3) = harness.run(2, collective_counts, 2)[0], harness.run(2, collective_counts, 3)[0]
    assert all_reduces(f3) - all_reduces(f2) == 2, (f2, f3)
    assert all_reduces(b3) - all_reduces(b2) == 2, (b2, b3)
    for counts in (f2, b2, f3, b3):
        assert not any("gather" in kind for kind in counts), counts
    # constant part: embedding all-reduce + 2 small loss all-reduces forward, LM-head input grad backward
    assert all_reduces(f2) == 2 * 2 + 3, f2
    assert all_reduces(b2) == 2 * 2 + 1, b2


def test_packed_dims_that_are_not_the_output_refused_before_sharding():
    """``c_attn`` fuses q|k|v along dim 1 of its ``Conv1D`` weight; a descriptor naming dim 0 would
    split the input features, so the walker refuses it, naming the module and the dims."""
    model = GPT2LMHeadModel(tiny(vocab=1000))
    spec = architecture_for(model).spec
    wrong = {"h.*.attn.c_attn": Packed(chunks=3, dims={"weight": 0, "bias": 0})}
    bad = dataclasses.replace(spec, base=dataclasses.replace(spec.base, packed=wrong))
    problems = collect(model, bad, tp=2).problems
    assert any(p.startswith("transformer.h.0.attn.c_attn: packed dims {'weight': 0} are not the output dims "
                            "of a Conv1D") for p in problems), problems
    assert not collect(model, spec, tp=2).problems
