"""SageMaker's marking API without registration: ``tensor_parallelism()`` /
``set_tensor_parallelism()`` on ``nn.Linear`` / ``nn.Embedding``, their keyword options
(``distribute_embedding``, block overrides reaching a directly built module, overrides nothing
uses), distributed modules built directly at sizes the degree does not divide, and delayed init.

A failure means a rule of SageMaker's (innermost block wins, indivisible or shared modules stay
whole) is broken, an option is ignored, bad input is not refused by name, or the distributed
model stops computing the single-process model's function. Kept apart from
``test_tp_register.py``, which tests user modules replaced through registration and its hooks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import harness
import modelparallel as smp
from reference import assert_close, sharded
from test_tp_register import CFG


def check_linear_embedding_marks(tp):
    smp.init({"tensor_parallel_degree": tp})

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            with smp.tensor_parallelism():
                self.emb = nn.Embedding(30, 20)
                self.m0 = nn.Linear(20, 20)                      # will be distributed
                with smp.tensor_parallelism(enabled=False):
                    self.m1 = nn.Linear(20, 20)                  # will not be distributed
                self.odd = nn.Linear(20, 15)                     # 15 not divisible: stays whole
                self.tied = nn.Linear(20, 30, bias=False)
                self.tied.weight = self.emb.weight               # shared weight: both stay whole
                self.plain = nn.Linear(15, 8)
            self.later = nn.Sequential(nn.Linear(8, 8))

        def forward(self, ids):
            h = self.emb(ids)
            h = self.odd(self.m1(self.m0(h)))
            return self.later(self.plain(h)), self.tied(torch.ones(20))

    torch.manual_seed(0)
    net = M()
    smp.set_tensor_parallelism(net.later, True)
    ref = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    kinds = {n: type(m).__name__ for n, m in model.module.named_children()}
    ids = torch.randint(0, 30, (2, 5))
    for got, want in zip(model(ids), ref(ids)):
        assert_close(got, want)
    return kinds, type(model.module.later[0]).__name__


def check_direct_sizes(tp, which):
    smp.init({"tensor_parallel_degree": tp})
    module = (smp.nn.DistributedLinear(8, 5) if which == "linear"
              else smp.nn.DistributedAttentionLayer(num_attention_heads=3, attention_head_size=4, hidden_size=12))
    try:
        smp.DistributedModel(module)
    except ValueError as e:
        return str(e)
    return None


def check_delayed_init(tp):
    smp.init({"tensor_parallel_degree": tp, "random_seed": 7})
    with smp.delay_param_initialization():
        module = smp.nn.DistributedTransformerLMHead(num_layers=1, vocab_size=50, num_positions=8,
                                                     use_normal_initialization=True, **{
                                                         k: v for k, v in CFG.items()})
    assert module.word_embedding.weight.is_meta
    model = smp.DistributedModel(module)
    assert isinstance(module.word_embedding.weight, DTensor) and not module.word_embedding.weight.to_local().is_meta
    return {k: v.clone() for k, v in model.state_dict().items()}


def check_unused_override():
    smp.init({"tensor_parallel_degree": 2})
    with smp.tensor_parallelism(causal_mask_size=4):
        net = nn.Sequential(nn.Linear(4, 4))
    try:
        smp.DistributedModel(net)
    except NotImplementedError as e:
        return str(e)
    return None


def test_linear_and_embedding_under_tensor_parallelism():
    kinds, later = harness.run(2, check_linear_embedding_marks, 2)[0]
    assert kinds["emb"] == "Embedding" and kinds["tied"] == "Linear", "shared weight: stays whole"
    assert kinds["m0"] == "DistributedLinear" and kinds["m1"] == "Linear", "innermost block wins"
    assert kinds["odd"] == "Linear" and kinds["plain"] == "DistributedLinear"
    assert later == "DistributedLinear", "set_tensor_parallelism after creation"


def test_direct_module_sizes_not_dividing_degree_raise():
    msg = harness.run(2, check_direct_sizes, 2, "linear")[0]
    assert msg is not None and "out_features = 5 is not divisible by tensor_parallel_degree 2" in msg
    msg = harness.run(2, check_direct_sizes, 2, "attention")[0]
    assert msg is not None and "local_attention_heads = 3 is not divisible by tensor_parallel_degree 2" in msg


def test_tensor_parallelism_options():
    with smp.tensor_parallelism(use_alibi=False, dtype=None, delayed_init=True, fused_softmax=False,
                                fused_bias_gelu=True, zero_init=True, flash_attention=None):
        pass
    with pytest.raises(NotImplementedError, match="use_alibi=True"):
        with smp.tensor_parallelism(use_alibi=True):
            pass
    with pytest.raises(TypeError, match="bogus"):
        smp.set_tensor_parallelism(nn.Linear(2, 2), True, bogus=1)
    msg = harness.run(2, check_unused_override)[0]
    assert msg is not None and "causal_mask_size" in msg


def test_delayed_init_gives_the_same_model_at_every_degree():
    one = harness.run(1, check_delayed_init, 1)[0]
    two = harness.run(2, check_delayed_init, 2)[0]
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=0, msg=key)
    w = one["transformer.seq_layers.0.attention.query.weight"]
    assert abs(w.std().item() - 0.02) < 0.004  # N(0, 0.02) over 1024 draws


def check_distribute_embedding_option(value):
    from transformers import GPT2Config, GPT2LMHeadModel

    smp.init({"tensor_parallel_degree": 2})
    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=50, n_positions=16)
    with smp.tensor_parallelism(distribute_embedding=value):
        model = GPT2LMHeadModel(cfg)
    smp.DistributedModel(model)
    wte, c_fc = model.transformer.wte.weight, model.transformer.h[0].mlp.c_fc.weight
    return sharded(wte), sharded(c_fc)


def test_distribute_embedding_option_is_honoured():
    assert harness.run(2, check_distribute_embedding_option, True)[0] == (True, True)
    assert harness.run(2, check_distribute_embedding_option, False)[0] == (False, True)


def check_block_overrides_direct_module():
    """A distributed module built at the top of a block takes the block's overrides."""
    smp.init({"tensor_parallel_degree": 2})
    kw = dict(hidden_size=8, intermediate_size=16, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    with smp.tensor_parallelism(activation="relu"):
        module = smp.nn.DistributedTransformerOutputLayer(**kw)
    ref = copy.deepcopy(module)
    ref.activation = "relu"
    model = smp.DistributedModel(module)
    x = torch.randn(2, 3, 8)
    assert_close(model(x), ref(x))
    return model.module.activation


def test_block_overrides_reach_a_directly_built_module():
    assert harness.run(2, check_block_overrides_direct_module)[0] == "relu"
