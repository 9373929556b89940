"""PyTorch's ``apply_activation_checkpointing`` applied before SageMaker v2's ``smp.transform``
(tensor parallelism, then FSDP2 or none): losses and first-step gradients equal one Hugging Face
process with the same checkpointing on the global batch (``reference.py``), the wrappers are still
around the blocks afterwards, and each block's region runs twice per step (forward + recompute).

A failure in ``transform`` itself ("rule 'layers.*...' matches no module") means the wrappers
were not set aside while the model was sharded (``activations/wrappers.py``, used by
``transform.py``); plain wrappers with a count of one run per step, that they were not put back.
"""

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointWrapper,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.fsdp import fully_shard
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp
from reference import assert_replicas_train_like_one_process, count_block_runs, sharded, token_batches
from test_v2_fsdp import llama_cfg

STEPS = 3


def checkpointed_before_transform(fsdp: bool):
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(llama_cfg())
    apply_activation_checkpointing(ref, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    model = smp.transform(copy.deepcopy(ref))
    assert all(type(m) is CheckpointWrapper for m in model.model.layers), list(model.model.layers)
    assert sharded(model.model.layers[0].get_submodule("_checkpoint_wrapped_module.mlp.up_proj").weight)
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer, mesh=smp.dp_mesh())
        fully_shard(model, mesh=smp.dp_mesh())
    runs = count_block_runs(model)
    assert_replicas_train_like_one_process(ref, model, token_batches(101, STEPS))
    assert len(runs) == 2 and all(n == 2 * STEPS for n in runs.values()), runs
    with pytest.raises(ValueError, match="CheckpointWrapper .*wrap what smp.transform returns"):
        smp.transform(checkpoint_wrapper(LlamaForCausalLM(llama_cfg())))


@pytest.mark.parametrize("fsdp,world", [(False, 2), (True, 4)])
def test_checkpointed_before_transform_trains_like_one_process(fsdp, world):
    harness.run(world, checkpointed_before_transform, fsdp)
