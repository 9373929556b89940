"""FSDP1 over tensor-parallel DTensor parameters: without sharding (TP=2 at data-parallel size 1,
where FSDP1 falls back to ``NO_SHARD`` over one rank, and ``hybrid_shard_degree`` 1 at TP=2 x
DP=2), and with an LM head tied to the embedding (sharded and not).

Before ``sagemaker/v2/fsdp1_dtensor_views.py`` these failed at the first forward ("Cannot writeback
when the parameter shape changes"; "Cannot flatten unevenly sharded tensor" with a vocabulary of
211 at TP=2) or the first backward (gradient views of the global shape). A failure here now means
FSDP1 re-created a DTensor parameter object the module or optimizer no longer shares (losses
stop falling like the single process's after step 1), or an enclosing FSDP unit flattened an
inner unit's parameters again. A failure of only the tied cases (losses off the single process
from step 2) means FSDP1 flattened the tied weight twice, so head and embedding trained apart.
"""

import copy
import functools

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer
from reference import assert_replicas_train_like_one_process, token_batches

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})


def cfg(vocab, tie=False):
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                       tie_word_embeddings=tie)


def no_shard_over_tp(config, vocab, use_orig_params, tie=False, strategy=ShardingStrategy.NO_SHARD):
    smp.init(config)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg(vocab, tie))
    model = smp.transform(copy.deepcopy(ref))
    model = FSDP(model, auto_wrap_policy=POLICY, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    assert model.sharding_strategy == strategy
    if tie:
        assert len(model._flat_param._shared_param_infos) == 1, "the tie was not recorded"
    assert len(FSDP.fsdp_modules(model)) == 3, "TransformerLayer did not wrap the two decoder layers"
    assert_replicas_train_like_one_process(ref, model, token_batches(vocab, 8), compare_grads=False)
    if use_orig_params:  # the optimizer's parameters are still the module's after training
        names = {id(p) for p in model.parameters()}
        assert all(id(getattr(m, "weight")) in names for m in model.modules()
                   if type(m).__name__.startswith("Colwise"))


@pytest.mark.parametrize("vocab", [100, 211])
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_tp2_at_dp1_trains_like_one_process(vocab, use_orig_params):
    harness.run(2, no_shard_over_tp, {"tensor_parallel_degree": 2}, vocab, use_orig_params)


def test_hybrid_shard_degree_1_at_tp2_trains_like_one_process():
    harness.run(4, no_shard_over_tp, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}, 100, True)


@pytest.mark.parametrize("world,strategy", [(2, ShardingStrategy.NO_SHARD), (4, ShardingStrategy.FULL_SHARD)])
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_tied_head_stays_tied_under_fsdp1_over_tp(world, strategy, use_orig_params):
    harness.run(world, no_shard_over_tp, {"tensor_parallel_degree": 2}, 100, use_orig_params, True, strategy)
