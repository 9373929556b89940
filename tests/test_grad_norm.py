"""``modelparallel.sagemaker.grad_norm.clip_grad_norm_(model, max_norm)`` with the FSDP1 model itself, as
SageMaker v2's train_lib calls it after every backward.

Both the single-process HF model and the FSDP1-wrapped transform of a copy clip to a small norm
every step; the norms must agree and the losses stay those of one process. A failure at TP=2
only means a TP-sharded parameter's slice of a flat shard was weighted as replicated (or the
reverse); without sharding (TP=2 at DP=1, hybrid degree 1) that the flat gradient was counted
once per data-parallel rank; with hybrid sharding, that replicas of a shard group were counted
as distinct blocks.
"""

import copy
import functools

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from modelparallel.sagemaker.grad_norm import clip_grad_norm_
from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer
from reference import assert_replicas_train_like_one_process, token_batches

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
MAX_NORM = 0.5


def clipped_like_one_process(config, use_orig_params, vocab=101):
    smp.init(config)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab))
    model = FSDP(smp.transform(copy.deepcopy(ref)), auto_wrap_policy=POLICY, device_id=torch.device("cpu"),
                 use_orig_params=use_orig_params)
    norms = []

    def clip_both(step):
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        got = clip_grad_norm_(model, MAX_NORM)
        # a sum of ~10^4 squares in fp32 in another order: eps 1.2e-7 x sqrt(10^4) ~ 1e-5
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m: f"step {step}: {m}")
        norms.append(want.item())

    assert_replicas_train_like_one_process(ref, model, token_batches(vocab, 6), after_backward=clip_both,
                                           compare_grads=False)
    assert min(norms) > MAX_NORM, f"clipping never scaled anything: norms {norms}"


@pytest.mark.parametrize("config,world", [
    ({"tensor_parallel_degree": 2}, 4),
    ({"tensor_parallel_degree": 2}, 2),
    ({"tensor_parallel_degree": 1}, 2),
    ({"tensor_parallel_degree": 1, "hybrid_shard_degree": 2}, 4),
], ids=["tp2-dp2", "tp2-dp1", "tp1-dp2", "tp1-hybrid2of4"])
def test_clip_fsdp1_model_equals_one_process(config, world):
    harness.run(world, clipped_like_one_process, config, True)


def test_clip_fsdp1_model_flat_parameters_uneven_vocab():
    """use_orig_params=False (optimizer over flat parameters) and a vocabulary TP does not divide."""
    harness.run(4, clipped_like_one_process, {"tensor_parallel_degree": 2}, False, 211)
