"""Marking and registration: which modules get distributed, and user modules made distributable.

A failure means modelparallel/tp/marks.py or the walker's handling of registrations is wrong;
the reference is the same user model run undistributed in one process.
"""

import copy
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Shard
from transformers import GPT2Config, GPT2LMHeadModel, OlmoConfig, OlmoForCausalLM

import harness
import modelparallel as smp
from reference import assert_close, sharded

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from custom_block import BLOCK_PLAN, Block, TinyLM  # noqa: E402


def check_registered_block(tp):
    smp.init({"tensor_parallel_degree": tp})
    calls = []
    smp.tp_register_with_module(Block, BLOCK_PLAN, return_hook=lambda out: calls.append(1) or out)
    torch.manual_seed(0)
    ref = TinyLM()
    model = smp.DistributedModel(copy.deepcopy(ref))
    assert isinstance(model.module.blocks[0].qkv.weight, DTensor)
    assert model.module.blocks[0].num_heads == 4 // tp
    ids = torch.randint(0, 97, (2, 16))
    out, want = model(ids), ref(ids)
    assert_close(out, want)
    assert len(calls) == 2, "return_hook runs once per block"
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert_close(g.reshape(q.grad.shape), q.grad, what=name)
    del Block._mp_tp_registration


def check_marks():
    smp.init({"tensor_parallel_degree": 2})
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    with smp.tensor_parallelism():
        model = GPT2LMHeadModel(cfg)
    smp.set_tensor_parallelism(model.transformer.h[1], False)
    ref = copy.deepcopy(model)
    dist_model = smp.DistributedModel(model)
    assert isinstance(dist_model.module.transformer.h[0].mlp.c_fc.weight, DTensor)
    assert not sharded(dist_model.module.transformer.h[1].mlp.c_fc.weight)
    ids = torch.randint(0, 100, (2, 8))
    assert_close(dist_model(ids).logits, ref(ids).logits)
    with smp.tensor_parallelism(enabled=False):
        off = GPT2LMHeadModel(cfg)
    smp.DistributedModel(off)
    assert not any(isinstance(p, DTensor) for p in off.parameters())


def check_no_plan(kind):
    """A model with no model file: an HF model (marked or not) gets the automatic plan; a plain
    module marked for tensor parallelism gets SageMaker's DistributedLinear for every nn.Linear."""
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    cfg = OlmoConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                     vocab_size=50, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    build = {"hf": lambda: OlmoForCausalLM(cfg),
             "plain": lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))}
    if kind in ("hf_marked", "plain_marked"):
        with smp.tensor_parallelism():
            model = build[kind.split("_")[0]]()
    else:
        model = build[kind.split("_")[0]]()
    ref = copy.deepcopy(model)
    smp.DistributedModel(model)
    if kind == "plain_marked":
        x = torch.randn(3, 16)
        assert_close(model(x), ref(x))
    else:
        ids = torch.randint(0, 50, (2, 8))
        assert_close(model(ids).logits, ref(ids).logits)
        assert tuple(model.model.layers[0].self_attn.q_proj.weight.placements) == (Shard(0),)
    return {type(m).__name__ for m in model.modules()}


def check_nothing_supported_strict():
    smp.init({"tensor_parallel_degree": 2})
    with smp.tensor_parallelism(strict=True):
        model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 1), torch.nn.LayerNorm(4))
    try:
        smp.DistributedModel(model)
    except ValueError as e:
        return str(e)
    return None


def check_wrap_twice():
    smp.init({"tensor_parallel_degree": 2})
    model = smp.DistributedModel(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)))
    errors = []
    for target in (model, model.module):
        try:
            smp.DistributedModel(target)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_registered_user_block_matches_undistributed():
    harness.run(2, check_registered_block, 2)


def test_marks_choose_what_is_distributed():
    harness.run(2, check_marks)


def test_model_without_plan_hf_gets_the_automatic_plan_plain_gets_distributed_linears():
    kinds = harness.run(2, check_no_plan, "plain_marked")[0]
    assert "DistributedLinear" in kinds and "Linear" not in kinds, "marked: every nn.Linear is distributed"
    for kind in ("hf_marked", "hf_unmarked"):
        assert "DistributedLinear" not in harness.run(2, check_no_plan, kind)[0], f"{kind}: the automatic plan"


def test_model_with_nothing_supported_refused_when_strict():
    msg = harness.run(2, check_nothing_supported_strict)[0]
    assert msg is not None and "Sequential" in msg and "no tensor-parallel plan" in msg and "strict" in msg


def test_distributed_model_twice_refused():
    for errors in harness.run(2, check_wrap_twice):
        assert len(errors) == 2 and all("already applied" in e for e in errors)
