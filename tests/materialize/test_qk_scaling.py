"""``query_key_layer_scaling`` (materialize/qk_scaling.py): a no-op outside float16, Megatron's
overflow guard in float16.

A failure in ``test_fp16_scores_that_overflow_stay_finite`` means the fp16 path no longer divides
the scores by the layer number before the product (HF's own fp16 attention gives inf/nan on the
same inputs, which the test also checks). A failure in ``test_no_effect_outside_fp16`` means the
option changed an fp32 model's logits: the wrapped implementation (eager or sdpa, masks
included) is no longer what runs. ``test_fp16_gpt2_close_to_fp32`` compares a whole fp16 GPT-2
built in ``smp.model_creation(query_key_layer_scaling=True)`` with the same model in fp32.
"""

import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2 import modeling_gpt2

import harness
import modelparallel as smp
from modelparallel.materialize import qk_scaling

FP16_EPS = 2.0 ** -10


def attention_module(layer_idx: int):
    return types.SimpleNamespace(layer_idx=layer_idx, is_causal=True, training=False, config=None)


def test_fp16_scores_that_overflow_stay_finite():
    torch.manual_seed(0)
    d, seq = 16, 6
    q = (60 + 20 * torch.rand(1, 2, seq, d)).half()  # q . k ~ 16 * 80 * 80 > 65504: fp16 overflows
    k = (60 + 20 * torch.rand(1, 2, seq, d)).half()
    v = torch.randn(1, 2, seq, d).half()
    scaling = d ** -0.5
    causal = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)
    plain, _ = modeling_gpt2.eager_attention_forward(attention_module(3), q, k, v, causal.half()[None, None],
                                                     scaling=scaling)
    assert not torch.isfinite(plain).all(), "the inputs must overflow fp16 without the scaling"
    fn = qk_scaling._implementation("eager")
    out, probs = fn(attention_module(3), q, k, v, None, scaling=scaling)
    ref_probs = torch.softmax(q.float() @ k.float().transpose(-1, -2) * scaling + causal, dim=-1)
    ref = (ref_probs.half().float() @ v.float()).transpose(1, 2)
    assert torch.isfinite(out).all()
    # scores ~ 1e3 after the 1/(sqrt(d) L) factor: their fp16 rounding is ~ 1e3 * eps, times L
    score_err = 4 * 80 * 80 * d * scaling * FP16_EPS
    assert (probs.float() - ref_probs).abs().max() <= score_err * ref_probs.max() + FP16_EPS
    assert (out.float() - ref).abs().max() <= (score_err + 4 * FP16_EPS) * v.abs().max() * seq


def build_gpt2(scaling: bool, fp16: bool, attn: str):
    """The same fp32 initialization every time; with ``fp16`` DistributedModel casts it."""
    smp.init({"tensor_parallel_degree": 1, "fp16": fp16})
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=61, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    with smp.model_creation(tensor_parallelism=True, query_key_layer_scaling=scaling,
                            flash_attention=attn == "sdpa"):
        model = GPT2LMHeadModel(config)
    model = smp.DistributedModel(model)
    ids = torch.arange(24).reshape(2, 12) * 5 % 61
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the padding mask reaches the attention function
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    return logits.float(), model.config._attn_implementation


def no_effect(attn):
    plain, name_plain = build_gpt2(False, False, attn)
    scaled, name_scaled = build_gpt2(True, False, attn)
    return torch.equal(plain, scaled), name_plain, name_scaled


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_no_effect_outside_fp16(attn):
    same, plain, scaled = harness.run(1, no_effect, attn)[0]
    assert scaled == qk_scaling.PREFIX + attn and plain == attn
    assert same, "query_key_layer_scaling changed an fp32 model's logits"


def fp16_vs_fp32():
    ref, _ = build_gpt2(False, False, "eager")
    half, name = build_gpt2(True, True, "eager")
    return ref, half, name


def test_fp16_gpt2_close_to_fp32():
    ref, half, name = harness.run(1, fp16_vs_fp32)[0]
    assert name == qk_scaling.PREFIX + "eager"
    # fp16 weights and activations through 3 layers: about 8 roundings of unit-scale values per
    # layer (eps/2 each) and a 32-term dot product for the logits; 64 eps of the largest logit
    # bounds them with room
    assert (half - ref).abs().max() <= 64 * FP16_EPS * ref.abs().max()
