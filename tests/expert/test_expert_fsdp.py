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


def fsdp2_training(arch, ep, tp):
    import modelparallel as smp

    ref = reference_model(arch)
    model = distributed_copy(ref, expert_parallel_degree=ep, tensor_parallel_degree=tp, prescaled_batch=True,
                             sharded_data_parallel_degree=4 // tp)
    train_like_one_process(ref, model, replica_batches(5, smp.rdp_size()), f"{arch} FSDP2 E={ep} T={tp}")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_sharded_data_parallel_with_experts_trains_like_one_process(arch):
    harness.run(4, fsdp2_training, arch, 2, 1)
