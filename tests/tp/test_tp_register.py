"""SageMaker's registration and marking API: ``@smp.tp_register`` / ``tp_register_with_module``
with a distributed module class and init/forward/return hooks, ``tensor_parallelism()`` /
``set_tensor_parallelism()`` on ``nn.Linear`` / ``nn.Embedding``, their keyword options,
``DistributedModel``'s tensor-parallel queries, delayed init and a partial checkpoint resumed
at another degree.

A failure means a registered module is not replaced (or replaced by the wrong thing), a hook is
not applied, a rule of SageMaker's (outermost module, innermost block wins, indivisible or shared
modules stay whole) is broken, bad input is not refused by name, or the distributed model stops
computing the single-process model's function (float32, tolerances as in test_nn_distributed).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import harness
import modelparallel as smp
from appendix_reference import RefLayer
from reference import assert_close, assert_grads_on_model_scale, sharded

CFG = dict(num_attention_heads=4, attention_head_size=8, hidden_size=32, intermediate_size=64,
           attention_dropout_prob=0.0, hidden_dropout_prob=0.0, causal_mask_size=8)


class MyLayer(RefLayer):
    """A user's transformer layer with its own interface, equal to the reference layer."""

    def __init__(self, config):
        super().__init__(**config)

    def forward(self, hidden_states, attention_mask=None):
        return super().forward((hidden_states, attention_mask))[0]


class Net(nn.Module):
    def __init__(self, layer_cls, config, marked=True):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        if marked:
            with smp.tensor_parallelism():
                self.layers = nn.ModuleList(layer_cls(config) for _ in range(2))
        else:
            self.layers = nn.ModuleList(layer_cls(config) for _ in range(2))
        self.head = nn.Linear(32, 10)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)



def _same_function(model, ref, ids):
    """Outputs and gradients agree (gradients on the model's gradient scale: see
    test_nn_distributed)."""
    out, want = model(ids), ref(ids)
    assert_close(out, want, what="output")
    out.sum().backward()
    want.sum().backward()
    assert_grads_on_model_scale(ref, model)


def check_decorator_with_hooks(tp):
    smp.init({"tensor_parallel_degree": tp})
    calls = []

    @smp.tp_register(smp.nn.DistributedTransformerLayer, init_hook=lambda config: ((), config),
                     forward_hook=lambda hidden_states, attention_mask=None: (((hidden_states, attention_mask),), {}),
                     return_hook=lambda out: calls.append(1) or out[0])
    class Layer(MyLayer):
        def __init__(self, config):
            super().__init__(config)

        def forward(self, hidden_states, attention_mask=None):
            return super().forward(hidden_states, attention_mask)

    torch.manual_seed(0)
    net = Net(Layer, CFG)
    ref = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    layer = model.module.layers[0]
    assert type(layer) is smp.nn.DistributedTransformerLayer
    assert isinstance(layer.attention.query.weight, DTensor) and not sharded(model.module.head.weight)
    _same_function(model, ref, torch.randint(0, 50, (2, 8)))
    assert len(calls) == 2, "return_hook runs once per layer call"
    dist_mods = list(model.distributed_modules())
    assert [type(m).__name__ for m in dist_mods] == ["DistributedTransformerLayer"] * 2
    q = layer.attention.query.weight
    assert model.is_distributed_parameter(q) and not model.is_distributed_parameter(model.module.head.weight)
    scaled = tp > 1  # prescaled_batch false: the TP group computes on the union of its ranks' batches
    n = len(list(model.parameters()))
    assert model.is_scaled_batch_parameter(q) == scaled
    assert len(list(model.scaled_batch_reducer_named_parameters())) == (n if scaled else 0)
    assert len(list(model.default_reducer_named_parameters())) == (0 if scaled else n)
    return True


def check_with_module_and_overrides(tp):
    """The docs' form: ``init_hook = lambda config: ((), config.to_dict())``; keys the distributed
    module does not take are dropped; block kwargs override the hook's."""
    smp.init({"tensor_parallel_degree": tp})

    class Config(types.SimpleNamespace):
        def to_dict(self):
            return dict(vars(self))

    class Block(MyLayer):
        def __init__(self, config):
            super().__init__(config.to_dict())

    smp.tp_register_with_module(Block, smp.nn.DistributedTransformerLayer,
                                init_hook=lambda config: ((), config.to_dict()),
                                forward_hook=lambda hidden_states, attention_mask=None: (((hidden_states, None),), {}),
                                return_hook=lambda out: out[0])
    torch.manual_seed(0)
    config = Config(**CFG, model_type="mine")
    with smp.tensor_parallelism(activation="relu"):
        net = Net(Block, config, marked=False)
    ref = copy.deepcopy(net)
    for layer in ref.layers:
        layer.output.act = "relu"
    model = smp.DistributedModel(net)
    assert model.module.layers[1].output.activation == "relu"
    _same_function(model, ref, torch.randint(0, 50, (2, 8)))
    return True


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


def check_bad_hook_return(tp):
    smp.init({"tensor_parallel_degree": tp})

    class Bad(MyLayer):
        pass

    smp.tp_register_with_module(Bad, smp.nn.DistributedTransformerLayer, init_hook=lambda config: config)
    with smp.tensor_parallelism():
        net = nn.Sequential(Bad(CFG))
    try:
        smp.DistributedModel(net)
    except TypeError as e:
        return str(e)
    return None


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


def test_decorator_with_init_forward_return_hooks():
    harness.run(2, check_decorator_with_hooks, 2)
    harness.run(1, check_decorator_with_hooks, 1)


def test_register_with_module_docs_form_and_block_overrides():
    harness.run(2, check_with_module_and_overrides, 2)


def test_linear_and_embedding_under_tensor_parallelism():
    kinds, later = harness.run(2, check_linear_embedding_marks, 2)[0]
    assert kinds["emb"] == "Embedding" and kinds["tied"] == "Linear", "shared weight: stays whole"
    assert kinds["m0"] == "DistributedLinear" and kinds["m1"] == "Linear", "innermost block wins"
    assert kinds["odd"] == "Linear" and kinds["plain"] == "DistributedLinear"
    assert later == "DistributedLinear", "set_tensor_parallelism after creation"


def test_bad_registrations_refused_by_name():
    class Mine(nn.Module):
        def __init__(self, config, scale=1.0):
            super().__init__()

        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="Linear.*not an smp.nn.DistributedModule"):
        smp.tp_register_with_module(Mine, nn.Linear)
    want = r"init_hook signature \(config\) must match Mine.__init__ \(config, scale=1.0\)"
    with pytest.raises(TypeError, match=want):
        smp.tp_register_with_module(Mine, smp.nn.DistributedTransformerLayer, init_hook=lambda config: ((), {}))
    with pytest.raises(TypeError, match="forward_hook signature"):
        smp.tp_register(smp.nn.DistributedTransformerLayer, forward_hook=lambda x, mask: ((x,), {}))(Mine)
    msg = harness.run(2, check_bad_hook_return, 2)[0]
    assert msg is not None and "init_hook of Bad must return (args, kwargs)" in msg


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
