"""Activation checkpointing of an expert-parallel Mixtral (and Qwen2-MoE) made by SageMaker v2's
``smp.transform(model, config=MoEConfig(...))``: PyTorch's ``apply_activation_checkpointing``
applied before ``transform`` (the wrappers set aside while it shards, put back after;
``activations/wrappers.py``) or after it, and Hugging Face's ``gradient_checkpointing_enable``
after it. Each trains like one HF process with the same checkpointing (every replica its own
batch; losses with the aux loss, every first-step gradient; losses only under the v2 scripts'
FSDP1 call) and runs each block's region twice per step (forward + recompute).

A failure in ``transform`` means the wrappers were not set aside; one run per step, that they
were not put back around the blocks; a wrong gradient or a hang only when checkpointed, that the
recompute repeats the experts' dispatch out of step (expert/dispatch.py).
"""

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

import harness
import modelparallel as smp
from modelparallel.expert.config import MoEConfig
from moe_reference import EXPERTS, reference_model, replica_batches, train_transformed_like_one_process
from reference import checkpointed_alike, count_block_runs

STEPS = 2
BLOCKS = (MixtralDecoderLayer, Qwen2MoeDecoderLayer)
AUX = dict(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.0)


def _checkpoint(model) -> None:
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, BLOCKS))


def checkpointed_experts(when: str, tp: int, arch: str, fsdp1: bool = False):
    """``when``: "before" (PyTorch's wrappers before ``transform``), "after" (after it), "hf"
    (``gradient_checkpointing_enable`` after it); the reference is checkpointed the same way.
    ``fsdp1``: then the v2 scripts' FSDP1 call without a mesh (experts set apart by
    expert/fsdp1.py, run inside the checkpointed blocks); losses only (flat parameters)."""
    smp.init({"expert_parallel_degree": 2, "tensor_parallel_degree": tp, "prescaled_batch": True})
    ref = reference_model(arch)
    ref.config.use_cache = False  # PyTorch's recompute would write the forward's keys into the cache again
    model = checkpointed_alike(ref, lambda m: smp.transform(m, config=MoEConfig(**AUX)), when, _checkpoint)
    experts = next(p for name, p in model.named_parameters() if "experts" in name)
    assert experts.to_local().shape[0] == EXPERTS // 2, (experts.placements, experts.to_local().shape)
    if fsdp1:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(BLOCKS))
        model = FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    runs = count_block_runs(model)
    train_transformed_like_one_process(ref, model, replica_batches(STEPS, smp.rdp_size()), f"checkpointed {when}",
                                       grads=not fsdp1)
    assert len(runs) == ref.config.num_hidden_layers and all(n == 2 * STEPS for n in runs.values()), runs


@pytest.mark.parametrize("when, tp, world, arch, fsdp1", [
    ("before", 1, 2, "mixtral", False),
    ("before", 2, 4, "mixtral", False),
    ("before", 1, 2, "qwen2_moe", False),  # a dense block between two sparse ones
    ("before", 1, 4, "mixtral", True),  # dp 4 (two replicas of each expert)
    ("after", 1, 2, "mixtral", False),
    ("hf", 1, 2, "mixtral", False),
])
def test_checkpointed_experts_train_like_one_process(when, tp, world, arch, fsdp1):
    harness.run(world, checkpointed_experts, when, tp, arch, fsdp1)
