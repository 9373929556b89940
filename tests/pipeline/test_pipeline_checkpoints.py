"""Checkpoints of pipelined models: every stage's shards in one partial checkpoint that resumes at
another (pipeline, tensor) layout exactly, a weight tied across stages stored once, SageMaker's
per-rank ``{f}_{pp_rank}_{tp_rank}`` files, a full checkpoint that is a Hugging Face directory,
and ``state_dict()`` / ``local_state_dict()`` with their documented meaning.

A failure in the resume test means a stage's keys are missing from the checkpoint or another
stage's keys are refused as unexpected (modelparallel/checkpoint/load/parts.py, optim_part.py with
pipeline/split.py's ``saved_names`` / ``elsewhere``); in the full-checkpoint test, that a later
stage's tensors do not reach rank 0 (checkpoint/save/full.py ``_to_writer``).
"""

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import harness
import modelparallel as smp
from reference import gathered, training_rtol
from test_pipeline_training import build, global_batch, my_rows, train_step


def _job(pp, tp, seed=1):
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2, "random_seed": seed})
    torch.manual_seed(seed)
    model = smp.DistributedModel(build("gpt2"))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt


def _steps(model, opt, first, count):
    losses = []
    for step in range(first, first + count):
        loss = train_step(model, my_rows(global_batch(step))).reduce_mean()
        losses.append(sum(smp.allgather(loss, smp.DP_GROUP)).item() / smp.dp_size())
        opt.step()
        opt.zero_grad()
    return losses


def _save_then_go_on(path, pp, tp):
    model, opt = _job(pp, tp)
    _steps(model, opt, 0, 2)
    smp.save_checkpoint(path, tag="step2", model=model, optimizer=opt, user_content={"step": 2})
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # a copy: training goes on
    if smp.rdp_rank() == 0:
        smp.save({"model": model.local_state_dict(), "optimizer": opt.local_state_dict()}, os.path.join(path, "legacy.pt"))
    smp.barrier()
    return _steps(model, opt, 2, 2), saved, sorted(os.listdir(path))


def _resume(path, pp, tp):
    model, opt = _job(pp, tp, seed=7)  # other weights, overwritten by the resume
    content = smp.resume_from_checkpoint(path, tag="step2")
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    return _steps(model, opt, 2, 2), loaded, content


@pytest.mark.parametrize("save_layout, load_layout", [
    ((2, 1), (1, 2)),   # pp 2 -> 1, tp 1 -> 2
    ((1, 2), (2, 1)),   # pp 1 -> 2
    ((2, 2), (4, 1)),   # pp 2 -> 4 (tp 2 -> 1)
    ((4, 1), (2, 2)),   # pp 4 -> 2 (tp 1 -> 2)
    ((2, 1), (2, 1)),   # same layout, with data parallelism beside
])
def test_partial_checkpoint_resumes_at_another_layout(tmp_path, save_layout, load_layout):
    world = 4
    path = str(tmp_path)
    first = harness.run(world, _save_then_go_on, path, *save_layout)
    second = harness.run(world, _resume, path, *load_layout)
    (want_losses, saved, files), (losses, loaded, content) = first[0], second[0]
    assert content == {"step": 2}
    assert set(saved) == set(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved), \
        "the resumed model holds exactly the saved weights"
    assert torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"])
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert abs(got - want) <= training_rtol(step + 2) * abs(want), (step, got, want)
    pp, tp = save_layout
    assert {f"legacy.pt_{p}_{t}" for p in range(pp) for t in range(tp)} <= set(files), files


def _tied_once(path):
    model, opt = _job(2, 1)
    _steps(model, opt, 0, 1)
    smp.save_checkpoint(path, tag="t", model=model, optimizer=opt)
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(os.path.join(path, "t_partial", "model")).read_metadata().state_dict_metadata
    optim = FileSystemReader(os.path.join(path, "t_partial", "optimizer")).read_metadata().state_dict_metadata
    return sorted(k for k in meta if "wte" in k or "lm_head" in k), sorted(k for k in optim if "lm_head" in k)


def test_tied_weight_stored_once(tmp_path):
    model_keys, optim_lm = harness.run(2, _tied_once, str(tmp_path))[0]
    assert model_keys == ["transformer.wte.weight"] and optim_lm == []


def _legacy_same_layout(path):
    model, opt = _job(2, 2)
    _steps(model, opt, 0, 1)
    f = os.path.join(path, "ckpt.pt")
    smp.save({"model": model.local_state_dict(), "optimizer": opt.local_state_dict()}, f)
    smp.barrier()
    want = _steps(model, opt, 1, 1)
    model2, opt2 = _job(2, 2, seed=9)
    state = smp.load(f)
    model2.load_state_dict(state["model"], same_partition_load=True)
    opt2.load_state_dict(state["optimizer"])
    return want, _steps(model2, opt2, 1, 1), sorted(os.listdir(path))


def test_legacy_save_names_each_stage_and_tp_rank(tmp_path):
    out = harness.run(4, _legacy_same_layout, str(tmp_path))
    want, got, files = out[0]
    assert got == want, "same layout: bit for bit"
    assert files == ["ckpt.pt_0_0", "ckpt.pt_0_1", "ckpt.pt_1_0", "ckpt.pt_1_1"]


def _full(path, pp, tp):
    model, opt = _job(pp, tp)
    _steps(model, opt, 0, 1)
    smp.save_checkpoint(path, tag="final", partial=False, model=model)
    local = model.local_state_dict()
    return model.state_dict(), sorted(local), sorted(model.state_dict(gather_to_rank0=True))


@pytest.mark.parametrize("pp, tp", [(2, 2), (4, 1)])
def test_full_checkpoint_is_a_hugging_face_directory(tmp_path, pp, tp):
    out = harness.run(4, _full, str(tmp_path), pp, tp)
    full = out[0][0]
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(tmp_path, "final"))
    theirs = hf.state_dict()
    assert set(theirs) == set(full)
    assert all(torch.equal(theirs[k], full[k].reshape(theirs[k].shape)) for k in full)
    assert hf.lm_head.weight is hf.transformer.wte.weight, "tied in the export"
    locals_ = [set(local) for _, local, _ in out]
    assert all(0 < len(s) < len(full) for s in locals_), "local_state_dict() holds this stage's entries only"
    assert out[0][2] == sorted(full) and all(r[2] == [] for r in out[1:]), "gather_to_rank0"
