"""SageMaker's registration API: ``@smp.tp_register`` / ``tp_register_with_module`` with a
distributed module class and init/forward/return hooks (the docs' ``config.to_dict()`` form,
block overrides), ``DistributedModel``'s tensor-parallel queries, and bad registrations refused
by name. Marking without registration is in ``test_tp_marking_api.py``; a registered model's
partial checkpoint resumed at another degree in ``test_tp_register_checkpoint.py``.

A failure means a registered module is not replaced (or replaced by the wrong thing), a hook is
not applied, bad input is not refused by name, or the distributed model stops computing the
single-process model's function (float32, tolerances as in test_nn_distributed).
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


def test_decorator_with_init_forward_return_hooks():
    harness.run(2, check_decorator_with_hooks, 2)
    harness.run(1, check_decorator_with_hooks, 1)


def test_register_with_module_docs_form_and_block_overrides():
    harness.run(2, check_with_module_and_overrides, 2)


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
