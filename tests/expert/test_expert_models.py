"""Mixtral and Qwen2-MoE under expert parallelism equal one Hugging Face process: logits, the loss
with HF's auxiliary load-balancing loss, every gradient, and 5 AdamW steps, at E=2 and E=4, with
expert replicas (E=2 on 4 data-parallel ranks), with TP for attention and the dense parts
(E=2 x T=2), and when every token picks the same expert.

Where to look: logits or loss wrong -> modelparallel/expert/dispatch.py (rows sent to the wrong
rank, combined in the wrong place); only expert gradients wrong -> the 1/ep gradient scale in
expert/style.py or the expert-replica average in model_grads.py (``_replica_groups``); dense gradients
wrong -> the data-parallel average; a Qwen2-MoE-only failure -> models/qwen2_moe.py's plan.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import harness
import modelparallel as smp
from moe_reference import (EXPERTS, distributed_copy, reference_model, replica_batches, train_like_one_process)


def _check_layout(model, ep):
    experts = [m for m in model.module.modules() if hasattr(m, "gate_up_proj")]
    assert experts, "no experts module found"
    for m in experts:
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(m, name)
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), f"{name}: {type(p).__name__}"
            assert p.device_mesh.mesh_dim_names == ("ep",) and p.shape[0] == EXPERTS
            assert p.to_local().shape[0] == EXPERTS // ep, f"{name}: local {tuple(p.to_local().shape)}"


def expert_parallel_training(arch, ep, tp=1):
    ref = reference_model(arch)
    model = distributed_copy(ref, expert_parallel_degree=ep, tensor_parallel_degree=tp, prescaled_batch=True)
    assert (smp.state.ep_size, smp.state.ep_rank) == (ep, smp.rdp_rank() % ep)
    _check_layout(model, ep)
    train_like_one_process(ref, model, replica_batches(5, smp.rdp_size()), f"{arch} E={ep} T={tp}")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("ep,tp,world", [pytest.param(2, 1, 2, marks=pytest.mark.smoke), (4, 1, 4), (2, 1, 4), (2, 2, 4)])
def test_expert_parallel_trains_like_one_process(arch, ep, tp, world):
    harness.run(world, expert_parallel_training, arch, ep, tp)


def one_expert_takes_every_token(arch):
    """Top-1 routing with a zero router: every token goes to expert 0 (rank 0's), the other
    ranks receive nothing and their experts get zero gradients, as in one process."""
    ref = reference_model(arch, top_k=1)
    for layer in ref.model.layers:
        if hasattr(layer.mlp, "gate"):
            torch.nn.init.zeros_(layer.mlp.gate.weight)
    model = distributed_copy(ref, expert_parallel_degree=2)
    train_like_one_process(ref, model, replica_batches(2, smp.rdp_size()), f"{arch} one expert")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_all_tokens_to_one_expert(arch):
    harness.run(2, one_expert_takes_every_token, arch)
