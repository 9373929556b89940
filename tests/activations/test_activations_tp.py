"""Activation checkpointing and offloading on a tensor-parallel GPT-2 equal single-process HF GPT-2.

A failure here means checkpointing a block of a ``DistributedModel`` (marked before or after
wrapping) changes the loss or a gradient, skips the recomputation, or recomputes the block's
collectives in a different number than its forward ran them. Look at
``modelparallel/activations/checkpointing.py`` first; offloading-only failures at ``offload.py``.
"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp
from modelparallel.activations import job_offloader
from reference import assert_close, assert_grads_match, assert_replicas_train_like_one_process, token_batches

LAYERS = 3


def tiny(dropout=0.0):
    return GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, vocab_size=500, n_positions=32, resid_pdrop=dropout,
                      embd_pdrop=dropout, attn_pdrop=dropout, pad_token_id=0)


def _ids():
    return torch.randint(1, 500, (2, 12), generator=torch.Generator().manual_seed(1))


def check_against_hf(tp, when, offload):
    smp.init({"tensor_parallel_degree": tp, "random_seed": 0, "offload_activations": offload,
              "activation_loading_horizon": 2})
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(tiny())
    module = copy.deepcopy(ref)
    if when == "before":
        smp.set_activation_checkpointing(module.transformer.h)
    model = smp.DistributedModel(module)
    if when == "after":
        smp.set_activation_checkpointing(model.module.transformer.h)
    mlp_calls = []
    model.module.transformer.h[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))  # recomputation may stop early, before a post-hook
    offloader = job_offloader()
    if offload:
        offloader.events = []
    ids = _ids()
    want, got = ref(ids, labels=ids), model(ids, labels=ids)
    assert_close(got.loss, want.loss, what="loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model)
    assert len(mlp_calls) == 2, f"block 0 ran {len(mlp_calls)} times: forward + recomputation expected"
    if offload:
        offloaded = {r for what, r in offloader.events if what == "offload"}
        used = {r for what, r in offloader.events if what == "use"}
        assert len(offloaded) == LAYERS and used == offloaded, offloader.events
        offloader.events = None
    else:
        assert offloader is None


def check_dropout_replayed(tp):
    """With dropout on, a checkpointed TP model's gradients equal the same model's without it."""
    grads = []
    for checkpointed in (False, True):
        smp.init({"tensor_parallel_degree": tp, "random_seed": 0})
        torch.manual_seed(0)
        model = smp.DistributedModel(GPT2LMHeadModel(tiny(dropout=0.2)))
        if checkpointed:
            smp.set_activation_checkpointing(model.module.transformer.h)
        torch.manual_seed(7)
        ids = _ids()
        model.backward(model(ids, labels=ids).loss)
        grads.append({n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                      for n, p in model.module.named_parameters()})
    for name, g in grads[0].items():
        # same kernels on the same inputs and masks; other masks would be off by O(1)
        assert_close(grads[1][name], g, what=f"grad {name}")


class AllReduceCount(TorchDispatchMode):
    """Counts all-reduce ops (CommDebugMode's module tracker cannot follow a recomputation)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "all_reduce" in str(func) or "allreduce" in str(func)
        return func(*args, **(kwargs or {}))


def backward_allreduces(checkpointed):
    smp.init({"tensor_parallel_degree": 2, "random_seed": 0})
    model = smp.DistributedModel(GPT2LMHeadModel(tiny()))
    if checkpointed:
        smp.set_activation_checkpointing(model.module.transformer.h)
    ids = _ids()
    loss = model(ids, labels=ids).loss
    with AllReduceCount() as bwd:
        loss.backward()
    return bwd.count


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("when,offload", [("before", False), ("after", False), ("after", True)])
def test_checkpointed_gpt2_equals_hf(tp, when, offload):
    harness.run(tp, check_against_hf, tp, when, offload)


@pytest.mark.parametrize("tp", [1, 2])
def test_dropout_masks_replayed(tp):
    harness.run(tp, check_dropout_replayed, tp)


def test_recomputation_repeats_each_blocks_forward_allreduces():
    plain, checkpointed = harness.run(2, backward_allreduces, False)[0], harness.run(2, backward_allreduces, True)[0]
    # A GPT-2 block all-reduces twice in forward (attention and MLP outputs). Recomputation stops
    # once the last tensor backward needs is rebuilt (the MLP projection's input), before the MLP's
    # all-reduce: one repeated all-reduce per block, the same on every rank.
    assert checkpointed - plain == LAYERS, (plain, checkpointed)


def check_patches_on_tensor_parallel_layers(tp):
    """``checkpoint`` / ``checkpoint_sequential`` around DTensor column/row-parallel layers."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from modelparallel.sagemaker.patches.checkpoint import checkpoint, checkpoint_sequential

    smp.init({"tensor_parallel_degree": tp, "random_seed": 0})
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(),
                        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    par = parallelize_module(copy.deepcopy(ref), smp.runtime.current().tp_mesh,
                             {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(),
                              "6": RowwiseParallel()})
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x_ref).square().sum().backward()
    checkpoint(par[6], checkpoint_sequential(par[:6], x_par, strategy="group_2")).square().sum().backward()
    # sharded sums against the unsharded model: the suite's reordered-rounding rule
    assert_close(x_par.grad, x_ref.grad, what="input grad")
    for (name, p), q in zip(par.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, what=f"grad {name}")


@pytest.mark.parametrize("tp", [1, 2])
def test_patches_checkpoint_on_tensor_parallel_layers(tp):
    harness.run(tp, check_patches_on_tensor_parallel_layers, tp)


def check_fsdp_training(steps=3):
    """FSDP2 over 2 data-parallel ranks, blocks checkpointed and offloaded, vs one process on the whole batch."""
    smp.init({"sharded_data_parallel_degree": 2, "random_seed": 0, "sm_activation_offloading": True})
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(tiny())
    model = smp.DistributedModel(copy.deepcopy(ref))
    smp.set_activation_checkpointing(model.module.transformer.h)
    mlp_calls = []
    model.module.transformer.h[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    assert_replicas_train_like_one_process(ref, model, token_batches(500, steps))
    assert len(mlp_calls) == 2 * steps, "block 0 was not recomputed in backward"


def test_checkpointed_and_offloaded_blocks_under_fsdp():
    harness.run(2, check_fsdp_training)
