"""Sharded data parallelism (FSDP2 over "dp") composed with TP on 4 ranks (TP=2 x DP=2).

Each data-parallel replica trains on half of the batch; the single-process HF model trains on the
whole batch. Equal first-step gradients and equal losses over 10 AdamW steps mean FSDP's
reduce-scatter averages exactly what the full batch's gradient is (and that DistributedModel no
longer all-reduces on top of it: a doubled gradient shows in the first step's gradients; AdamW's
losses barely move under a constant factor). A failure in the meta variant but not
the real one points at loading into FSDP-sharded parameters (loading.py / meta.py).
"""

import copy

import torch
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from reference import assert_replicas_train_like_one_process, token_batches

CONFIG = {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}
STEPS = 10


def fsdp_gpt2():
    smp.init(CONFIG)
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg)
    model = smp.DistributedModel(copy.deepcopy(ref))
    w = model.module.transformer.h[0].mlp.c_fc.weight
    assert isinstance(w, DTensor) and w.device_mesh.ndim == 2 and w.to_local().numel() == w.numel() // 4
    assert_replicas_train_like_one_process(ref, model, token_batches(1000, STEPS))


def test_fsdp_tp_training_equals_single_process():
    harness.run(4, fsdp_gpt2)


def fsdp_meta_llama(path):
    smp.init(CONFIG)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    ref = LlamaForCausalLM.from_pretrained(path)
    ref.train()
    with torch.device("meta"):
        model = smp.DistributedModel(LlamaForCausalLM(cfg))
    smp.load_hf_checkpoint(model, path)
    assert_replicas_train_like_one_process(ref, model, token_batches(101, STEPS))


def test_fsdp_tp_meta_model_loaded_shard_on_read(tmp_path):
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=101,
                                 max_position_embeddings=64)).save_pretrained(tmp_path)
    harness.run(4, fsdp_meta_llama, str(tmp_path))


def fsdp_from_rank0_only():
    """Only global rank 0 holds weights; ranks of the other data-parallel group get their blocks
    from it too (their TP mesh does not contain rank 0)."""
    smp.init(CONFIG)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    torch.manual_seed(6)
    ref = LlamaForCausalLM(cfg)
    if smp.rank() == 0:
        model = copy.deepcopy(ref)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    assert_replicas_train_like_one_process(ref, smp.DistributedModel(model), token_batches(101, STEPS))


def test_fsdp_tp_weights_from_rank0_only():
    harness.run(4, fsdp_from_rank0_only)


def shard_optimizer_state_gpt2():
    """SageMaker's ``shard_optimizer_state``: optimizer state split over the rdp ranks (a quarter
    of each TP-sharded weight per rank at TP=2 x rdp 2), training as plain data parallelism does."""
    smp.init({"tensor_parallel_degree": 2, "shard_optimizer_state": True})
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg)
    model = smp.DistributedModel(copy.deepcopy(ref))
    assert_replicas_train_like_one_process(ref, model, token_batches(1000, 4))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = token_batches(1000, 1)[0][:2]
    model.backward(model(ids, labels=ids).loss)
    opt.step()
    w = model.module.transformer.h[0].mlp.c_fc.weight
    moment = opt.state[w]["exp_avg"]
    assert isinstance(moment, DTensor) and moment.to_local().numel() == w.numel() // 4, moment.to_local().shape


def test_shard_optimizer_state_splits_state_over_rdp_and_trains_like_one_process():
    harness.run(4, shard_optimizer_state_gpt2)
