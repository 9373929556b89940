"""The ``smp.nn`` distributed modules against a plain single-process reference written from
SageMaker's appendix (tests/appendix_reference.py) on 1, 2 and 4 ranks.

A failure means a distributed module computes another function than the reference (outputs,
gradients, one optimizer step), its state dict does not load into the reference layout and back,
an option is not honoured, or a size the degree does not divide is not refused by name.

Tolerances: float32 throughout, from ``reference.tolerance`` (reordered sums differ by rounding
only). Gradients are judged on the scale of the model's largest gradient: some are zero in exact
arithmetic (the key bias under softmax), so what both sides hold there is rounding noise of the
size of the other gradients, not of their own.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import harness
import modelparallel as smp
from reference import assert_close, assert_grads_on_model_scale, sharded, tolerance
from appendix_reference import RefAttention, RefLayer, RefLMHead, RefOutput, RefTransformer

SIZES = dict(num_attention_heads=4, attention_head_size=8, hidden_size=32, intermediate_size=64,
             attention_dropout_prob=0.0, hidden_dropout_prob=0.0)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _pair(build_dist, build_ref, tp, seed=0):
    """(DistributedModel, reference with the distributed module's initial weights)."""
    smp.init({"tensor_parallel_degree": tp, "random_seed": seed})
    torch.manual_seed(seed)
    module = build_dist()
    ref = build_ref()
    ref.load_state_dict(module.state_dict())  # the reference layout: same names, same shapes
    return smp.DistributedModel(module), ref


def _compare_training(model, ref, run):
    """Forward, backward and one SGD step agree with the reference; the full state dict after
    the step loads back into the reference layout. (SGD, not Adam: Adam's first step moves every
    weight by about lr * sign(grad), which turns float32 noise in near-zero gradients into
    lr-sized differences.)"""
    out, want = run(model), run(ref)
    assert_close(out, want, what="output")
    out.sum().backward()
    want.sum().backward()
    grad_tol = assert_grads_on_model_scale(ref, model)
    for params in (model.parameters(), ref.parameters()):
        opt = torch.optim.SGD(params, lr=0.1)
        opt.step()
    full = model.state_dict()
    for name, want_t in ref.state_dict().items():
        atol = tolerance(want_t) + 0.1 * grad_tol  # the weights' own rounding, plus lr x the gradients'
        torch.testing.assert_close(full[name], want_t, rtol=0, atol=atol, msg=name)
    ref.load_state_dict(full)
    return [n for n, p in model.module.named_parameters() if sharded(p)]


def _mask(n, s, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 1, 1, s, generator=g) < 0.2).float() * -10000.0


def check_attention(tp, cross, causal, pre, post):
    kw = dict(SIZES, cross_attention=cross, causal_mask_size=8 if causal else None, pre_layernorm=pre,
              post_layernorm=post)
    kw.pop("intermediate_size")
    model, ref = _pair(lambda: smp.nn.DistributedAttentionLayer(**kw), lambda: RefAttention(**kw), tp)
    x, c = torch.randn(2, 8, 32), torch.randn(2, 5, 32)
    inputs = (x, c, _mask(2, 5)) if cross else (x, _mask(2, 8))
    sharded = _compare_training(model, ref, lambda m: m(inputs))
    assert model.module.local_attention_heads == 4 // tp
    return sharded


def attention_backward_all_reduces(cross):
    """All-reduces in one backward of a TP=2 attention layer: one per distinct input of q, k and v
    (their input gradients summed over the ranks once per input, not once per projection)."""
    from torch.distributed.tensor.debug import CommDebugMode

    kw = dict(SIZES, cross_attention=cross)
    kw.pop("intermediate_size")
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    model = smp.DistributedModel(smp.nn.DistributedAttentionLayer(**kw))
    x, c = torch.randn(2, 8, 32, requires_grad=True), torch.randn(2, 5, 32, requires_grad=True)
    out = model((x, c, None) if cross else (x, None))
    with CommDebugMode() as mode:
        out.sum().backward()
    return sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op))


def test_attention_input_gradient_is_all_reduced_once_per_input():
    assert harness.run(2, attention_backward_all_reduces, False) == [1, 1]
    assert harness.run(2, attention_backward_all_reduces, True) == [2, 2]


def check_output_layer(tp, activation, pre, post, fp32):
    kw = dict(hidden_size=32, intermediate_size=64, hidden_dropout_prob=0.0, activation=activation,
              pre_layernorm=pre, post_layernorm=post, fp32_residual_addition=fp32)
    model, ref = _pair(lambda: smp.nn.DistributedTransformerOutputLayer(**kw), lambda: RefOutput(**kw), tp)
    x = torch.randn(2, 8, 32)
    return _compare_training(model, ref, lambda m: m(x))


def check_transformer(tp, cross):
    kw = dict(SIZES, causal_mask_size=8, add_cross_attention=cross, use_normal_initialization=True,
              initializer_range=0.05)
    model, ref = _pair(lambda: smp.nn.DistributedTransformer(num_layers=2, **kw),
                       lambda: RefTransformer(num_layers=2, **kw), tp)
    x, c = torch.randn(2, 8, 32), torch.randn(2, 6, 32)
    inputs = (x, c, _mask(2, 8), _mask(2, 6, seed=2)) if cross else (x, _mask(2, 8))
    out = model(inputs)
    assert len(out) == len(inputs) and all(a is b for a, b in zip(out[1:], inputs[1:])), "masks are passed on"
    w = _full(model.module.seq_layers[0].attention.query.weight)
    # N(0, 0.05) weights (use_normal_initialization): the sample std of 1024 draws is within 20%
    assert abs(w.std().item() - 0.05) < 0.01 and _full(model.module.seq_layers[0].output.dense1.bias).abs().max() == 0
    return _compare_training(model, ref, lambda m: m(inputs)[0])


def check_layer_is_attention_then_output(tp):
    kw = dict(SIZES, pre_layernorm=True, post_layernorm=False, activation="relu")
    model, ref = _pair(lambda: smp.nn.DistributedTransformerLayer(**kw), lambda: RefLayer(**kw), tp)
    x = torch.randn(2, 8, 32)
    return _compare_training(model, ref, lambda m: m((x, None))[0])


def check_lm_head(tp, causal):
    kw = dict(SIZES, causal_mask_size=8 if causal else None)
    dist_kw = dict(kw, num_layers=2, vocab_size=50, num_positions=8, num_token_types=2)
    model, ref = _pair(lambda: smp.nn.DistributedTransformerLMHead(**dist_kw),
                       lambda: RefLMHead(2, 50, 8, num_token_types=2, **{k: v for k, v in kw.items()
                                                                             if k != "hidden_size"},
                                         hidden_size=32), tp)
    g = torch.Generator().manual_seed(3)
    ids, types = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 2, (2, 8), generator=g)
    mask = (torch.rand(2, 8, generator=g) < 0.2).long()
    logits = model((ids, mask, types, None, None))
    assert_close(logits, ref(ids, mask, types, None), what="logits")
    sharded = _compare_training(model, ref, lambda m: m((ids, mask, types, None, ids)) if m is model
                                else m(ids, mask, types, ids))
    assert model.module.lm_head.weight is model.module.word_embedding.weight, "LM head stays tied"
    return sharded


def test_attention_layer_options_on_2_ranks():
    options = [(False, True, False, True), (True, False, True, False), (False, False, True, True)]
    for cross, causal, pre, post in options:
        sharded = harness.run(2, check_attention, 2, cross, causal, pre, post)[0]
        assert {"query.weight", "key.weight", "value.weight", "dense.weight"} <= set(sharded)


def test_attention_layer_on_1_and_4_ranks():
    harness.run(1, check_attention, 1, False, True, False, True)
    sharded = harness.run(4, check_attention, 4, False, True, True, False)[0]
    assert "query.weight" in sharded


def test_output_layer_options():
    for activation, pre, post, fp32 in [("gelu", False, True, False), ("relu", True, False, True),
                                        ("gelu", True, True, False)]:
        sharded = harness.run(2, check_output_layer, 2, activation, pre, post, fp32)[0]
        assert {"dense1.weight", "dense1.bias", "dense2.weight"} <= set(sharded)


def test_transformer_with_and_without_cross_attention():
    sharded = harness.run(2, check_transformer, 2, True)[0]
    assert "seq_layers.1.cross_attention.key.weight" in sharded
    harness.run(4, check_transformer, 4, False)


def test_transformer_layer_pre_layernorm_relu():
    harness.run(2, check_layer_is_attention_then_output, 2)


def test_lm_head_causal_and_masked():
    sharded = harness.run(2, check_lm_head, 2, True)[0]
    assert "word_embedding.weight" in sharded
    harness.run(2, check_lm_head, 2, False)
    harness.run(4, check_lm_head, 4, True)


def test_options_reach_every_submodule_and_bad_values_are_refused():
    """Single process: constructor options land where the reference puts them."""
    import pytest
    from torch import nn

    head = smp.nn.DistributedTransformerLMHead(num_layers=2, num_attention_heads=4, attention_head_size=8,
                                               hidden_size=32, intermediate_size=64, vocab_size=50, num_positions=8,
                                               attention_dropout_prob=0.2, hidden_dropout_prob=0.3,
                                               layernorm_epsilon=1e-3, activation="relu", pre_layernorm=True,
                                               post_layernorm=True, add_lm_head=False)
    layer = head.transformer.seq_layers[1]
    assert layer.attention.dropout1.p == 0.2 and layer.attention.dropout2.p == 0.3 and layer.output.dropout.p == 0.3
    assert head.dropout.p == 0.3 and layer.output.activation == "relu"
    assert layer.attention.pre_layernorm.eps == layer.output.layernorm.eps == 1e-3
    assert not hasattr(head, "lm_head") and not hasattr(head, "token_type_embedding")
    ids = torch.randint(0, 50, (2, 8))
    head.eval()
    out = head((ids, None, None, None, None))
    assert out.shape == (2, 8, 32), "without add_lm_head the transformer's output is returned"
    torch.testing.assert_close(head((ids, None, None, None, None)), out, rtol=0, atol=0)
    head.train()
    assert not torch.equal(head((ids, None, None, None, None)), out), "dropout is active in training"
    assert isinstance(smp.nn.FusedLayerNorm(8, eps=1e-3), nn.LayerNorm)
    with pytest.raises(ValueError, match="at least one of pre_layernorm and post_layernorm"):
        smp.nn.DistributedTransformerLayer(pre_layernorm=False, post_layernorm=False)
    with pytest.raises(ValueError, match="activation must be 'gelu' or 'relu'"):
        smp.nn.DistributedTransformerOutputLayer(activation="tanh")
    with pytest.raises(NotImplementedError, match="_skip_allgather=True"):
        smp.nn.DistributedEmbedding(10, 4, _skip_allgather=True)
    with pytest.raises(ValueError, match="sequence length 9 exceeds causal_mask_size 8"):
        smp.nn.DistributedAttentionLayer(4, 8, 32, causal_mask_size=8)((torch.randn(1, 9, 32), None))
