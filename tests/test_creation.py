"""SageMaker v1's ``smp.model_creation`` / ``smp.delay_param_initialization``: models built inside
hold no storage until ``DistributedModel`` gives each rank its shard, and every option is either
honoured or refused by name.

A failure means modelparallel/creation.py (or materialize/weights.py, which applies the options): a refused
option accepted silently, an option without effect (dtype, distribute_embedding,
flash_attention), or a delayed model that differs from the eager one.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from reference import assert_close, sharded
from modelparallel.materialize import meta

IDS = torch.tensor([[3, 17, 42, 99, 5, 0, 64, 23]])


def cfg():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)


@pytest.mark.parametrize("option", ["use_alibi", "attention_in_fp32", "fp32_residual_addition"])
def test_numerics_changing_options_refused_by_name(option):
    with pytest.raises(NotImplementedError, match=option):
        with smp.model_creation(**{option: True}):
            pass
    assert torch.get_default_dtype() == torch.float32


def test_options_that_only_pick_kernels_accepted_and_nothing_allocated():
    with smp.model_creation(zero_init=True, fused_softmax=False, fused_dropout=True, fused_bias_gelu=True,
                            dtype=torch.bfloat16):
        model = LlamaForCausalLM(cfg())
    assert torch.get_default_dtype() == torch.float32, "default dtype not restored"
    assert all(meta.is_meta(p) and p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(meta.is_meta(b) for b in model.buffers())


def embedding_and_attention(distribute_embedding, flash_attention):
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})  # same batch on TP ranks
    torch.manual_seed(2)
    eager = LlamaForCausalLM(cfg())
    torch.manual_seed(2)
    with smp.model_creation(tensor_parallelism=True, distribute_embedding=distribute_embedding,
                            flash_attention=flash_attention):
        model = LlamaForCausalLM(cfg())
    model = smp.DistributedModel(model)
    module = model.module
    assert sharded(module.model.embed_tokens.weight) == distribute_embedding
    assert sharded(module.lm_head.weight) == distribute_embedding
    q = module.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q, DTensor) and q.to_local().shape == (32, 64), "each rank holds only its shard"
    assert module.config._attn_implementation == ("sdpa" if flash_attention else "eager")
    out = model(IDS, labels=IDS)
    want = eager(IDS, labels=IDS)
    assert_close(out.loss, want.loss)
    logits = out.logits.full_tensor() if isinstance(out.logits, DTensor) else out.logits
    assert_close(logits, want.logits)


@pytest.mark.parametrize("distribute_embedding,flash_attention", [(False, True), (True, False)])
def test_model_creation_at_tp2_equals_eager(distribute_embedding, flash_attention):
    harness.run(2, embedding_and_attention, distribute_embedding, flash_attention)


def bf16_and_untouched_modules():
    smp.init({"tensor_parallel_degree": 2})
    with smp.model_creation(tensor_parallelism=False, dtype=torch.bfloat16):
        model = LlamaForCausalLM(cfg())
    model = smp.DistributedModel(model)
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 and not isinstance(p, DTensor) and not meta.is_meta(p) for p in params)
    assert model.module.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.isfinite(model(IDS).logits).all()


def test_dtype_and_tensor_parallelism_false():
    harness.run(2, bf16_and_untouched_modules)
