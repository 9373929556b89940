"""Expert parallelism under sharded data parallelism equals one process: v1's
``sharded_data_parallel_degree`` (FSDP2: dense parameters over every data-parallel rank, each
experts module over the ranks holding the same experts).

Where to look: a shape or placement error -> modelparallel/training/fsdp.py (the experts
modules' own FSDP group over ``Runtime.edp_mesh``); expert gradients off by a factor -> the 1/ep
gradient scale in expert/style.py against FSDP's average over its mesh.
"""

import pytest

import harness
from moe_reference import distributed_copy, reference_model, replica_batches, train_like_one_process


def fsdp2_training(arch, ep, tp, shard=None):
    import modelparallel as smp

    ref = reference_model(arch)
    model = distributed_copy(ref, expert_parallel_degree=ep, tensor_parallel_degree=tp, prescaled_batch=True,
                             sharded_data_parallel_degree=shard or 4 // tp)
    if shard is not None:  # hybrid: dense parameters in shard groups, experts replicated over their pair
        dense = model.module.model.layers[0].self_attn.q_proj.weight.device_mesh
        experts = model.module.model.layers[0].mlp.experts.gate_up_proj.device_mesh
        assert dense.mesh_dim_names[:2] == ("replicate", "shard") and dense.size(1) == shard, dense
        assert experts.mesh_dim_names[:2] == ("edp_replicate", "edp_shard") and experts.size(0) == 2, experts
    train_like_one_process(ref, model, replica_batches(5, smp.rdp_size()), f"{arch} FSDP2 E={ep} T={tp}")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_sharded_data_parallel_with_experts_trains_like_one_process(arch):
    harness.run(4, fsdp2_training, arch, 2, 1)


def test_hybrid_sharding_with_experts_trains_like_one_process():
    """dp 4, ep 2, sharded_data_parallel_degree 2: FSDP2's (replicate, shard) mesh for the dense
    parameters, the experts' own replicas (2 per ep rank) replicated."""
    harness.run(4, fsdp2_training, "mixtral", 2, 1, 2)
