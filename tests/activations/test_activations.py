"""Activation checkpointing and offloading in one process, against the same model run plainly.

A failure here means ``modelparallel/activations`` (or ``modelparallel/sagemaker/patches/checkpoint.py``)
changed what the model computes, split a container into other regions than its strategy says,
lost the random state between forward and recomputation, or reloaded offloaded tensors in the
wrong order. Gradient mismatches: look at ``run_checkpointed``; wrong region order: ``segments``;
offload order: ``ActivationOffloader._prefetch_before``.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import modelparallel as smp
from modelparallel.activations import ActivationOffloader, offloader_for, segments
from modelparallel.config import build_config
from modelparallel.sagemaker.patches.checkpoint import checkpoint, checkpoint_sequential
from reference import assert_close


def _assert_same_grads(got: nn.Module, want: nn.Module):
    # Recomputation replays the same fp32 kernels on the same inputs, well inside the suite's
    # reordered-rounding rule; a wrong region or RNG state is off by O(1).
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert_close(p.grad, q.grad, what=f"grad {name}")


def _mlp(layers=5, dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(dropout)) for _ in range(layers)])


def _run(model, fn, seed=3, rows=4):
    torch.manual_seed(seed)
    x = torch.randn(rows, 16, requires_grad=True)
    fn(model, x).square().mean().backward()
    return x.grad


def _recompute_order(model: nn.Sequential) -> list[int]:
    """Indices of the layers run during backward (the recomputation), in order."""
    calls, phase = [], {"backward": False}
    for i, layer in enumerate(model):
        layer[0].register_forward_pre_hook(lambda *_, i=i: calls.append(i) if phase["backward"] else None)
    torch.manual_seed(3)
    loss = model(torch.randn(4, 16, requires_grad=True)).sum()
    phase["backward"] = True
    loss.backward()
    return calls


@pytest.mark.parametrize("strategy,regions", [
    ("each", [[0], [1], [2], [3], [4]]), ("contiguous", [[0, 1, 2, 3, 4]]),
    ("group_2", [[0, 1], [2, 3], [4]]), ("group_3", [[0, 1, 2], [3, 4]]), ("group_7", [[0, 1, 2, 3, 4]]),
])
def test_strategy_splits_sequential_into_regions(strategy, regions):
    assert [list(r) for r in segments(5, strategy)] == regions
    model = _mlp()
    smp.set_activation_checkpointing(model, strategy=strategy)
    # backward reaches the last region first and recomputes it front to back
    assert _recompute_order(model) == [i for region in reversed(regions) for i in region]


@pytest.mark.parametrize("strategy", ["each", "contiguous", "group_2"])
def test_set_activation_checkpointing_gradients_equal(strategy):
    want, got = _mlp(), _mlp()
    smp.set_activation_checkpointing(got, strategy=strategy)
    assert_close(_run(got, lambda m, x: m(x)), _run(want, lambda m, x: m(x)), what="input grad")
    _assert_same_grads(got, want)
    assert list(dict(got.named_parameters())) == list(dict(want.named_parameters())), "parameter names changed"


def test_preserve_rng_state_keeps_dropout_masks():
    want, got, lost = _mlp(dropout=0.5), _mlp(dropout=0.5), _mlp(dropout=0.5)
    smp.set_activation_checkpointing(got)
    smp.set_activation_checkpointing(lost, preserve_rng_state=False)
    for model in (want, got, lost):
        _run(model, lambda m, x: m(x))
    _assert_same_grads(got, want)
    # without the saved state the recomputation draws new masks: the gradients must differ
    assert any(not torch.allclose(p.grad, q.grad) for p, q in zip(lost.parameters(), want.parameters()))


def test_patches_checkpoint_and_checkpoint_sequential():
    want, got = _mlp(dropout=0.3), _mlp(dropout=0.3)
    _run(want, lambda m, x: m[4](m[1:4](m[0](x))))
    _run(got, lambda m, x: checkpoint(m[4], checkpoint_sequential(m[1:4], checkpoint(m[0], x), "group_2")))
    _assert_same_grads(got, want)
    assert smp.patches.checkpoint.checkpoint is checkpoint


def test_module_list_each_and_plain_module():
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
    ref = copy.deepcopy(layers)
    smp.set_activation_checkpointing(layers)
    assert all(smp.activations.is_activation_checkpointed(m) for m in layers)
    _run(layers, lambda m, x: m[2](m[1](m[0](x))))
    _run(ref, lambda m, x: m[2](m[1](m[0](x))))
    _assert_same_grads(layers, ref)
    twin = copy.deepcopy(layers)  # a copy runs its own weights, not the original's
    with torch.no_grad():
        twin[0].weight.zero_()
    assert not torch.equal(twin[0](torch.ones(1, 16)), layers[0](torch.ones(1, 16)))


def test_offloading_round_trip_keeps_gradients_and_loads_ahead():
    want, got = _mlp(layers=6), _mlp(layers=6)
    offloader = ActivationOffloader(horizon=2, force_copy=True)  # copies even on CPU: the transfer path runs
    offloader.events = []

    def forward(m, x):
        for layer in m:
            with offloader.region():
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x
    _run(got, forward, rows=32)  # 2 KiB per activation: above the offloader's minimum size
    _run(want, lambda m, x: m(x), rows=32)
    _assert_same_grads(got, want)
    events = offloader.events
    regions = sorted({r for what, r in events if what == "offload"})
    assert len(regions) == 6, events
    for r in regions:
        first_use = events.index(("use", r))
        loaded = {rr for what, rr in events[:first_use] if what == "load"}
        expected = {rr for rr in regions if r - 2 <= rr <= r}  # itself and the two saved before it
        assert expected <= loaded and not loaded & {rr for rr in regions if rr < r - 2}, (r, events)


def test_offloading_config_keys_v1_and_v2():
    for key in ("offload_activations", "sm_activation_offloading"):
        cfg = build_config({key: True, "activation_loading_horizon": 3}, world_size=1)
        assert offloader_for(cfg).horizon == 3
    assert offloader_for(build_config({}, world_size=1)) is None
    assert offloader_for(SimpleNamespace(offload_activations=True)).horizon == 4  # SageMaker's default
    with pytest.raises(ValueError, match="activation_loading_horizon"):
        build_config({"offload_activations": True, "activation_loading_horizon": 0}, world_size=1)


@pytest.mark.parametrize("strategy", ["every", "group_0", "group_x", "group_", "", 2])
def test_unknown_strategy_named(strategy):
    with pytest.raises(ValueError, match=f"strategy {strategy!r}"):
        smp.set_activation_checkpointing(_mlp(), strategy=strategy)
    with pytest.raises(ValueError, match=f"strategy {strategy!r}"):
        checkpoint_sequential(_mlp(), torch.ones(1, 16), strategy=strategy)


def test_bad_modules_named():
    with pytest.raises(TypeError, match="ModuleList"):
        checkpoint_sequential(nn.ModuleList([nn.Linear(2, 2)]), torch.ones(1, 2))
    with pytest.raises(TypeError, match="Linear"):
        checkpoint_sequential(nn.Linear(2, 2), torch.ones(1, 2))
    with pytest.raises(TypeError, match="function"):
        checkpoint(torch.tanh, torch.ones(2))
    with pytest.raises(ValueError, match="Linear"):
        smp.set_activation_checkpointing(nn.Linear(2, 2), strategy="group_2")
    with pytest.raises(NotImplementedError, match="ModuleList"):
        smp.set_activation_checkpointing(nn.ModuleList([nn.Linear(2, 2)]), strategy="group_2")
    with pytest.raises(TypeError, match="nn.Module"):
        smp.set_activation_checkpointing(torch.tanh)


def test_key_value_cache_left_out_of_checkpointed_layers():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    want = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    got = copy.deepcopy(want)
    smp.set_activation_checkpointing(got.transformer.h)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    out_want, out_got = want(ids, labels=ids, use_cache=True), got(ids, labels=ids, use_cache=True)
    assert_close(out_got.loss, out_want.loss, what="loss")
    out_want.loss.backward()
    out_got.loss.backward()
    _assert_same_grads(got, want)
    assert out_got.past_key_values.get_seq_length() == 0  # never filled, so never filled twice
    with torch.no_grad():
        prefix = want(ids, use_cache=True).past_key_values
    with pytest.raises(NotImplementedError, match="GPT2Block.*past_key_values"):
        got(ids, past_key_values=prefix)


class _TupleLayer(nn.Module):
    """Takes and returns ``(hidden, mask)``, as SageMaker's distributed transformer layers do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, inp):
        hidden, mask = inp
        return torch.tanh(self.linear(hidden)) * mask, mask


def test_tuple_inputs_with_pack_args_as_tuple():
    torch.manual_seed(0)
    want = nn.Sequential(*[_TupleLayer() for _ in range(4)])
    got = copy.deepcopy(want)
    smp.set_activation_checkpointing(got, pack_args_as_tuple=True, strategy="group_2")
    grads = []
    for model in (want, got):
        torch.manual_seed(3)
        hidden, mask = torch.randn(4, 16, requires_grad=True), torch.rand(4, 16, requires_grad=True)
        model((hidden, mask))[0].square().sum().backward()
        grads.append((hidden.grad, mask.grad))
    _assert_same_grads(got, want)
    for g_got, g_want, name in zip(grads[1], grads[0], ("hidden", "mask")):
        assert_close(g_got, g_want, what=f"{name} grad")
