"""Checkpoints across context-parallel degrees: context parallelism splits sequences, not weights,
so a checkpoint saved at C=2 is the one a C=1 job saves, and loads bit-exactly at C=1 (one rank,
or two data-parallel ranks) and back at C=2, model and AdamW state alike; the same through
PyTorch's DCP for a ``transform``ed model (the v2 path).

A failure names the first tensor that differs: the checkpoint layer (modelparallel/checkpoint/)
would then treat the context-parallel ranks as holding different shards, or the manifest's
layout would refuse a change of degree that changes nothing stored.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from state_helpers import gathered_state

VOCAB = 96


def _llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32))


def build(cp: int, seed: int):
    smp.init({"context_parallel_degree": cp, "random_seed": seed})
    model = smp.DistributedModel(_llama(seed))
    return model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def train(model, optimizer, steps: int) -> None:
    for step in range(steps):
        ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))
        rows = smp.get_batch_for_cp_rank(ids[smp.rdp_rank()::smp.rdp_size()])
        model.backward(model(rows, labels=rows).loss)
        optimizer.step()
        optimizer.zero_grad()


state = gathered_state  # every model tensor and AdamW slot at its global shape, by name


def save(cp: int, path: str) -> dict:
    model, optimizer = build(cp, seed=0)
    train(model, optimizer, 2)
    smp.save_checkpoint(path, "step_2", user_content={"step": 2})
    return state(model, optimizer)


def load(cp: int, path: str, expected: dict):
    model, optimizer = build(cp, seed=7)  # another seed: an ignored load cannot pass
    assert not torch.equal(state(model, optimizer)["model/lm_head.weight"], expected["model/lm_head.weight"])
    content = smp.resume_from_checkpoint(path)
    got = state(model, optimizer)
    assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))
    for key, want in expected.items():
        assert torch.equal(got[key], want), f"{key}: not bit-equal at context_parallel_degree {cp}"
    train(model, optimizer, 1)  # and it trains on from there
    return content


def test_saved_at_c2_loads_at_c1_and_back(tmp_path):
    expected = harness.run(2, save, 2, str(tmp_path / "c2"))[0]
    for world in (1, 2):  # C=1 on one rank, and on two data-parallel ranks
        assert harness.run(world, load, 1, str(tmp_path / "c2"), expected) == [{"step": 2}] * world
    expected = harness.run(1, save, 1, str(tmp_path / "c1"))[0]
    assert harness.run(2, load, 2, str(tmp_path / "c1"), expected) == [{"step": 2}] * 2


def dcp_round_trip(cp: int, path: str, write: bool) -> dict:
    """v2: ``transform`` + AdamW, saved or loaded with PyTorch's DCP state-dict helpers."""
    smp.init({"context_parallel_degree": cp})
    model = smp.transform(_llama(0 if write else 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = smp.get_batch_for_cp_rank(torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0)))
    model(ids, labels=ids).loss.backward()
    for p in model.parameters():  # the data x context average FSDP would do
        dist.all_reduce(p.grad, group=smp.get_cp_process_group())
        p.grad /= smp.cp_size()
    if write:
        optimizer.step()
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer))), checkpoint_id=path)
    else:
        optimizer.step()  # state to load into
        sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_dcp_checkpoint_of_a_transformed_model_moves_between_degrees(tmp_path):
    saved = harness.run(2, dcp_round_trip, 2, str(tmp_path), True)[0]
    loaded = harness.run(1, dcp_round_trip, 1, str(tmp_path), False)[0]
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
