"""Expert parallelism composed with the rest of training: activation checkpointing (the
recomputation repeats the layer's all-to-alls on every rank alike), mixed precision (bf16 with
fp32 master weights, the experts' included), and SageMaker's default batch layout under TP
(``prescaled_batch`` false: each TP rank brings its own batch and the TP group computes on their
union).

Where to look: checkpointing -> recomputation order of the collectives in expert/dispatch.py;
bf16 -> dtypes in expert/dispatch.py ``_combine`` and the masters of DTensor experts in
training/master_weights.py; the union batch -> training/batch.py against the experts' tokens.
"""

import pytest
import torch

import harness
import modelparallel as smp
from moe_reference import (distributed_copy, reference_model, replica_batches, train_like_one_process,
                           train_on_tensor_parallel_unions)
from reference import training_rtol


def checkpointed(arch):
    ref = reference_model(arch)
    model = distributed_copy(ref, expert_parallel_degree=2)
    smp.set_activation_checkpointing(model.module.model.layers)
    runs = []
    model.module.model.layers[0].mlp.experts.register_forward_pre_hook(lambda *_: runs.append(1))
    train_like_one_process(ref, model, replica_batches(2, smp.rdp_size()), f"{arch} checkpointed")
    assert len(runs) == 4, f"layer 0's experts ran {len(runs)} times in 2 steps: forward + recomputation each"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_activation_checkpointing(arch):
    harness.run(2, checkpointed, arch)


def bf16_losses(ep):
    model = distributed_copy(reference_model("mixtral"), expert_parallel_degree=ep, bf16=True)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for batches in replica_batches(4, smp.rdp_size()):
        ids = batches[smp.rdp_rank()]
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        assert model.module.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
        losses.append(loss.item())
    return losses


def test_bf16_expert_parallel_trains_like_bf16_data_parallel():
    """bf16 at E=2 against the same job at E=1 (plain data parallelism): only the dispatch differs,
    so each step's loss agrees within bf16 rounding."""
    want = harness.run(2, bf16_losses, 1)
    got = harness.run(2, bf16_losses, 2)
    for rank, (g, w) in enumerate(zip(got, want)):
        for step, (a, b) in enumerate(zip(g, w)):
            assert abs(a - b) / abs(b) < training_rtol(step, torch.bfloat16), (rank, step, g, w)


def union_batches():
    """prescaled_batch false at E=2 x T=2: each rank's own batch, the TP group's union is one
    replica's batch."""
    ref = reference_model("mixtral")
    model = distributed_copy(ref, expert_parallel_degree=2, tensor_parallel_degree=2)
    train_on_tensor_parallel_unions(ref, model, 3, 2)


def test_union_batch_of_the_tensor_parallel_group():
    harness.run(4, union_batches)
