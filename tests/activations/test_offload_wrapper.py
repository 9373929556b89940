"""``sm_activation_offloading`` with PyTorch's ``offload_wrapper`` around a checkpointed FSDP1 x TP
model, as SageMaker v2's train_lib builds it (``checkpoint_wrapper`` with the reentrant
implementation on each ``TransformerLayer``, then ``offload_wrapper(model)``).

PyTorch's own wrapper fails on a tensor-parallel model (its host copy mixes a plain tensor with
a DTensor); with the key set, ``activations/offload_wrapper.py`` runs both wrappers on the
library's offloader. A failure of the training test means the offloaded run no longer equals one
process (a tensor restored wrong) or offloading never happened (no per-layer regions recorded).
"""

import copy
import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper, offload_wrapper)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from modelparallel.activations import job_offloader
from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer
from reference import assert_replicas_train_like_one_process, token_batches


def scripts_model(offloading):
    smp.init({"tensor_parallel_degree": 2, "sm_activation_offloading": offloading})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                       use_cache=False))  # as the scripts: a reentrant recompute would extend the cache
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    model = FSDP(smp.transform(copy.deepcopy(ref)), auto_wrap_policy=policy, device_id=torch.device("cpu"),
                 use_orig_params=True)
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: isinstance(m, TransformerLayer))
    return ref, offload_wrapper(model)


def offloaded_training():
    ref, model = scripts_model(True)
    offloader = job_offloader()
    offloader.events = []
    assert_replicas_train_like_one_process(ref, model, token_batches(101, 4), compare_grads=False)
    offloaded = {region for what, region in offloader.events if what == "offload"}
    used = {region for what, region in offloader.events if what == "use"}
    # per step: the forward outside the layers and each of the two checkpointed layers
    assert len(offloaded) == 3 * 4 and used == offloaded, (len(offloaded), len(used))
    offloader.events = None


def test_offload_wrapper_over_fsdp1_tp_trains_like_one_process():
    harness.run(2, offloaded_training)


def native_wrapper_fails():
    _, model = scripts_model(False)
    ids = token_batches(101, 1)[0]
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        model(ids, labels=ids).loss.backward()


def test_without_the_key_pytorch_wrapper_runs_and_fails_on_dtensors():
    harness.run(2, native_wrapper_fails)
