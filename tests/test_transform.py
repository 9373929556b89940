"""``smp.transform`` and the sync from rank 0 (``load_state_dict_from_rank0=True``, and a
``DistributedModel`` of a model that only rank 0 holds).

A failure means modelparallel/transform.py (or the rank-0 path of materialize/weights.py) gives a rank
something other than its shard of rank 0's weights: compare the local shard with the slice of
the reference. A refusal test failing means a rank-0 model on meta was accepted, which would
leave every rank with uninitialized memory ("random metrics after sync_module_states").
"""

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from modelparallel.materialize import meta
from reference import as_hf, assert_close

IDS = torch.tensor([[3, 17, 42, 99, 5, 0, 64, 23]])


def llama_cfg():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)


def gpt2_cfg():
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=32, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def _reference_and_rank0_model(cls, cfg, seed):
    torch.manual_seed(seed)
    ref = cls(cfg)  # built on every rank, only to compare with
    if smp.rank() == 0:
        torch.manual_seed(seed)
        return ref, cls(cfg)
    with torch.device("meta"):
        return ref, cls(cfg)


def _assert_shards_of(model, ref):
    for name, p in model.named_parameters():
        assert not meta.is_meta(p), name
        torch.testing.assert_close(as_hf(p, ref.get_parameter(name)), ref.get_parameter(name), rtol=0, atol=0)
    for name, b in ref.named_buffers():
        assert torch.equal(model.get_buffer(name), b), name


def transform_from_rank0(cls, cfg):
    smp.init({"tensor_parallel_degree": 2})
    ref, model = _reference_and_rank0_model(cls, cfg, seed=21)
    out = smp.transform(model, load_state_dict_from_rank0=True)
    assert out is model
    q = model.get_submodule("model.layers.0.self_attn.q_proj" if cls is LlamaForCausalLM else "transformer.h.0.mlp.c_fc")
    assert isinstance(q.weight, DTensor) and q.weight.to_local().numel() == q.weight.numel() // 2
    _assert_shards_of(model, ref)
    assert_close(model(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("cls,cfg", [(LlamaForCausalLM, llama_cfg()), (GPT2LMHeadModel, gpt2_cfg())])
def test_transform_load_from_rank0_gives_each_rank_its_shard(cls, cfg):
    harness.run(2, transform_from_rank0, cls, cfg)


def transform_everywhere():
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(3)
    ref = LlamaForCausalLM(llama_cfg())
    torch.manual_seed(3)
    model = smp.transform(LlamaForCausalLM(llama_cfg()), dtype=torch.float64)
    assert model.lm_head.weight.dtype == torch.float64
    assert_close(model(IDS).logits, ref.double()(IDS).logits, what="fp64 logits")


def test_transform_real_model_in_place_with_dtype():
    harness.run(2, transform_everywhere)


def distributed_model_from_rank0():
    smp.init({"tensor_parallel_degree": 2})
    ref, model = _reference_and_rank0_model(GPT2LMHeadModel, gpt2_cfg(), seed=8)
    model = smp.DistributedModel(model)
    _assert_shards_of(model.module, ref)
    assert model.module.lm_head.weight is model.module.transformer.wte.weight


def test_distributed_model_of_rank0_only_weights():
    harness.run(2, distributed_model_from_rank0)


def rank0_on_meta_refused():
    smp.init({"tensor_parallel_degree": 2})
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_cfg())
    with pytest.raises(smp.MetaTensorError, match="needs real weights on rank 0"):
        smp.transform(model, load_state_dict_from_rank0=True)


def test_rank0_on_meta_refused_on_every_rank():
    harness.run(2, rank0_on_meta_refused)
