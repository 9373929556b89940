"""Partial checkpoints reshard: saved at one TP/DP layout, loaded bit-exactly at another.

A failure here means a partial checkpoint (modelparallel/checkpoint/save/partial.py, parts.py) lost or
reordered values: look first at the first tensor named in the assertion. Model and optimizer
state (exp_avg, exp_avg_sq, step) are compared with ``torch.equal`` against the values gathered
before the save; the vocabulary (1001) divides by no degree used here. Training resumed from a
checkpoint must reproduce the uninterrupted run's losses exactly (fp32, same data).
"""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import state_helpers
import modelparallel as smp
from state_helpers import train_steps


def cfg():
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=1001, n_positions=16, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def llama_cfg():
    """Grouped-query attention (8 query heads, 4 KV heads: TP=4 splits both) and an untied head."""
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=1001, max_position_embeddings=32,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


ARCHS = {"gpt2": lambda: GPT2LMHeadModel(cfg()), "llama": lambda: LlamaForCausalLM(llama_cfg())}


def batch(step: int) -> torch.Tensor:
    return (torch.arange(24).reshape(2, 12) * (step + 7) + step) % 1001


def build(tp: int, seed: int, arch: str = "gpt2"):
    smp.init({"tensor_parallel_degree": tp, "random_seed": seed})
    model = smp.DistributedModel(ARCHS[arch]())
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return model, optimizer


def train(model, optimizer, steps: range) -> list[float]:
    # each replica (both its TP ranks) its half of every batch
    return train_steps(model, optimizer, [batch(step)[smp.rdp_rank()::smp.rdp_size()] for step in steps])


def gathered_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every model tensor, optimizer state slot and the loss scale at its global shape, by name
    (a collective)."""
    return {**state_helpers.gathered_state(model, optimizer),
            "scaler/loss_scale": torch.tensor(optimizer.loss_scaler.loss_scale)}


def save_after_training(tp: int, path: str, tag: str, arch: str = "gpt2"):
    model, optimizer = build(tp, seed=0, arch=arch)
    train(model, optimizer, range(2))
    smp.save_checkpoint(path, tag, user_content={"step": 2, "note": "hello"})
    return gathered_state(model, optimizer)


def load_elsewhere(tp: int, path: str, expected: dict, defer: bool, arch: str = "gpt2"):
    """Resume into a fresh model of another seed (so an ignored load would be caught)."""
    if defer:
        smp.init({"tensor_parallel_degree": tp, "random_seed": 5})
        content = smp.resume_from_checkpoint(path)
        model, optimizer = build_without_init(arch)
    else:
        model, optimizer = build(tp, seed=5, arch=arch)
        before = gathered_state(model, optimizer)
        changed = [k for k in expected if k.startswith("model/") and not torch.equal(before[k], expected[k])]
        assert changed, "fresh model already equal: the load would prove nothing"
        content = smp.resume_from_checkpoint(path)
    got = gathered_state(model, optimizer)
    assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))
    for key, want in expected.items():
        assert torch.equal(got[key], want), f"{key}: not bit-equal after resharding to tp={tp}"
    return content


def build_without_init(arch: str):
    model = smp.DistributedModel(ARCHS[arch]())
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return model, optimizer


def test_saved_at_tp2_loads_bit_exactly_at_tp1_tp4_and_dp2(tmp_path):
    expected = harness.run(2, save_after_training, 2, str(tmp_path), "step_2")[0]
    assert expected["optim/transformer.wte.weight/exp_avg"].shape == (1001, 32)
    assert (tmp_path / "newest").read_text().strip() == "step_2_partial"
    for world, tp, defer in ((1, 1, False), (4, 4, True), (4, 2, False)):
        contents = harness.run(world, load_elsewhere, tp, str(tmp_path), expected, defer)
        assert contents == [{"step": 2, "note": "hello"}] * world


def test_llama_saved_at_tp2_loads_bit_exactly_at_tp1_and_tp4(tmp_path):
    expected = harness.run(2, save_after_training, 2, str(tmp_path), "llama", "llama")[0]
    assert expected["optim/lm_head.weight/exp_avg_sq"].shape == (1001, 32), "untied head saved on its own"
    for world, defer in ((1, False), (4, True)):
        harness.run(world, load_elsewhere, world, str(tmp_path), expected, defer, "llama")


def test_saved_at_tp2_dp2_loads_at_tp4(tmp_path):
    expected = harness.run(4, save_after_training, 2, str(tmp_path), "dp")[0]
    harness.run(4, load_elsewhere, 4, str(tmp_path), expected, False)


def save_fsdp_tp(path: str):
    """TP=2 x FSDP2 over dp=2: parameters and optimizer state are 2-D DTensors."""
    smp.init({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "random_seed": 0})
    model = smp.DistributedModel(GPT2LMHeadModel(cfg()))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    train(model, optimizer, range(2))
    smp.save_checkpoint(path, "fsdp_export", partial=False)
    smp.save_checkpoint(path, "fsdp", user_content="fsdp")  # saved last: the one newest names
    return gathered_state(model, optimizer)


def test_fsdp_by_tp_checkpoint_loads_at_plain_tp4_and_exports(tmp_path):
    expected = harness.run(4, save_fsdp_tp, str(tmp_path))[0]
    assert harness.run(4, load_elsewhere, 4, str(tmp_path), expected, False)[0] == "fsdp"
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "fsdp_export").state_dict()
    for key, value in exported.items():
        assert torch.equal(value.reshape(expected[f"model/{key}"].shape), expected[f"model/{key}"]), key


def resumed_losses(tp: int, path: str, total: int, cut: int):
    """Losses of steps [cut, total) after a save at ``cut`` and a resume into a fresh job."""
    model, optimizer = build(tp, seed=0)
    train(model, optimizer, range(cut))
    smp.save_checkpoint(path, f"step_{cut}", user_content={"step": cut})
    model, optimizer = build(tp, seed=123)
    step = smp.resume_from_checkpoint(path)["step"]
    return train(model, optimizer, range(step, total))


def uninterrupted_losses(tp: int, total: int):
    model, optimizer = build(tp, seed=0)
    return train(model, optimizer, range(total))


@pytest.mark.smoke
def test_training_resumed_from_checkpoint_repeats_the_same_losses(tmp_path):
    want = harness.run(2, uninterrupted_losses, 2, 6)[0]
    got = harness.run(2, resumed_losses, 2, str(tmp_path), 6, 3)[0]
    assert got == want[3:], (got, want)
