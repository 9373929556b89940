"""Checkpoints of expert-parallel models hold every expert by its global index: a partial
checkpoint saved at E=2 resumes bit-exactly at E=1 and E=4 (weights and AdamW state), training
resumed at the same layout repeats the uninterrupted run's losses, and a full checkpoint is a
Hugging Face directory that ``from_pretrained`` (and ``load_state_dict(strict=True)``) reads.

A failure names the first tensor that differs: experts at the wrong index -> the expert DTensors
(modelparallel/expert/style.py, ``Shard(0)`` over "ep"); missing or renamed keys in the export ->
models/mixtral.py or qwen2_moe.py ``TABLE``.
"""

import pytest
import torch
from safetensors.torch import load_file

import harness
import modelparallel as smp
from state_helpers import gathered_state, train_steps
from moe_reference import ARCHS, reference_model, replica_batches


def build(arch: str, ep: int, seed: int, tp: int = 1):
    smp.init({"expert_parallel_degree": ep, "tensor_parallel_degree": tp, "random_seed": seed, "prescaled_batch": True})
    model = smp.DistributedModel(reference_model(arch, seed=seed))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return model, optimizer


def train(model, optimizer, steps: range) -> list[float]:
    data = replica_batches(max(steps.stop, 1), 4)  # the same global batch at every layout
    return train_steps(model, optimizer, [torch.cat(data[step])[smp.rdp_rank()::smp.rdp_size()] for step in steps])


def save_after_training(arch: str, path: str, ep: int, tp: int = 1):
    model, optimizer = build(arch, ep, seed=0, tp=tp)
    train(model, optimizer, range(2))
    smp.save_checkpoint(path, "step_2", user_content={"step": 2})
    smp.save_checkpoint(path, "export", partial=False)
    return gathered_state(model, optimizer)


def load_elsewhere(arch: str, path: str, ep: int, expected: dict, tp: int = 1):
    model, optimizer = build(arch, ep, seed=7, tp=tp)
    before = gathered_state(model, optimizer)
    assert any(not torch.equal(before[k], v) for k, v in expected.items() if k.startswith("model/")), \
        "a fresh model already equal: the load would prove nothing"
    content = smp.resume_from_checkpoint(path, tag="step_2")
    got = gathered_state(model, optimizer)
    assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))
    for key, want in expected.items():
        assert torch.equal(got[key], want), f"{key}: not bit-equal after resharding to E={ep}, T={tp}"
    return content


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_saved_at_e2_resumes_bit_exactly_at_e1_and_e4(arch, tmp_path):
    expected = harness.run(2, save_after_training, arch, str(tmp_path), 2)[0]
    experts = expected["model/model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.shape[0] == 4 and "optim/model.layers.0.mlp.experts.down_proj/exp_avg" in expected
    for world, ep, tp in ((2, 1, 1), (4, 4, 1), (4, 2, 2)):
        assert harness.run(world, load_elsewhere, arch, str(tmp_path), ep, expected, tp) == [{"step": 2}] * world
    export = tmp_path / "export"
    cls = ARCHS[arch][0]
    hf = cls.from_pretrained(export)
    files = load_file(export / "model.safetensors")
    fresh = reference_model(arch, seed=3)
    missing, unexpected = fresh.load_state_dict(files, strict=True)  # every key HF has, nothing else
    for key, value in hf.state_dict().items():
        assert torch.equal(value, expected[f"model/{key}"]), key
        assert torch.equal(fresh.state_dict()[key], value), key


def resumed_losses(arch: str, path: str, total: int, cut: int):
    model, optimizer = build(arch, 2, seed=0)
    train(model, optimizer, range(cut))
    smp.save_checkpoint(path, f"step_{cut}", user_content={"step": cut})
    model, optimizer = build(arch, 2, seed=123)
    step = smp.resume_from_checkpoint(path)["step"]
    return train(model, optimizer, range(step, total))


def uninterrupted_losses(arch: str, total: int):
    model, optimizer = build(arch, 2, seed=0)
    return train(model, optimizer, range(total))


def test_training_resumed_repeats_the_same_losses(tmp_path):
    want = harness.run(2, uninterrupted_losses, "mixtral", 4)
    got = harness.run(2, resumed_losses, "mixtral", str(tmp_path), 4, 2)
    assert got == [w[2:] for w in want], (got, want)
