"""Virtual pipeline stages (``pipeline_virtual_stages``, ours) train exactly like one Hugging Face
process on the global batch.

Each case cuts a tiny 4-layer model into pipeline_parallel_degree x 2 stages (one layer each;
rank r runs stages r and r + P, so each rank holds two non-contiguous layers) and runs
``@smp.step`` through PyTorch's interleaved 1F1B or looped BFS schedule; it compares with an
untouched HF model in fp32: every local gradient and the weights after one SGD step, the losses
of AdamW steps, and that GPT-2's ``wte`` (first stage, rank 0) and ``lm_head`` (last stage, rank
P - 1) stay identical. A checkpoint saved with virtual stages resumes without them, and at
pipeline degree 1, with the same weights.

A gradient mismatch with right stage ranges means a stage ran another stage's blocks or the
wrong activation (modelparallel/pipeline/stage.py ``Boundary.running``); a layer held twice or
by no rank, that pipeline/split.py's ``apply`` kept the wrong blocks.
"""

import pytest
import torch

import harness
import modelparallel as smp
from modelparallel.config import build_config
from reference import tolerance, training_rtol
from test_pipeline_training import (LAYERS, adamw_steps, build, global_batch, my_rows, one_sgd_step, setup,
                                    train_step)

V = {"pipeline_virtual_stages": 2}


def _one_step(arch, pp, tp, microbatches, schedule, **extra):
    names, loss, ref_loss = one_sgd_step(arch, pp, tp, microbatches, schedule, **V, **extra)
    return names, loss, ref_loss


@pytest.mark.parametrize("world, arch, pp, tp, microbatches, schedule", [
    pytest.param(2, "gpt2", 2, 1, 2, "interleaved", marks=pytest.mark.smoke),
    (2, "gpt2", 2, 1, 4, "simple"),
    (2, "llama", 2, 1, 4, "interleaved"),
    (4, "gpt2", 2, 2, 2, "interleaved"),   # x tensor parallelism
    (4, "llama", 2, 1, 2, "interleaved"),  # x data parallelism
])
def test_one_step_equals_one_process(world, arch, pp, tp, microbatches, schedule):
    out = harness.run(world, _one_step, arch, pp, tp, microbatches, schedule)
    held = {n for names, _, _ in out for n in names}
    want = {n for n, _ in build(arch).named_parameters(remove_duplicate=False)}
    assert held == want, f"parameters no rank holds: {sorted(want - held)}; unknown: {sorted(held - want)}"
    for names, _, _ in out:  # two layers each, one of each half of the model
        layers = sorted({int(n.split(".")[2]) for n in names if n.split(".")[1] in ("h", "layers")})
        assert len(layers) == 2 * LAYERS // (2 * pp) and layers[1] - layers[0] == pp, layers
    mean = sum(loss for _, loss, _ in out) / world
    assert abs(mean - out[0][2]) <= training_rtol(0) * abs(out[0][2]), (mean, out[0][2])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_adamw_steps_equal_one_process(arch):
    out = harness.run(2, adamw_steps, arch, 2, 1, 2, "interleaved", steps=3, **V)
    for step, (loss, want) in enumerate(out[0][0]):
        assert abs(loss - want) <= training_rtol(step) * abs(want), (step, loss, want)
    copies = [t for _, tied in out for t in tied.values()]
    if arch == "gpt2":
        assert len(copies) == 2 and torch.equal(copies[0], copies[1]), "wte and lm_head must stay identical"


@smp.step
def logits_step(model, ids):
    return model(ids).logits


def _forward_only(schedule):
    ref, model = setup("gpt2", 2, 1, 4, schedule, **V)
    ids = global_batch(0)
    with torch.no_grad():
        return logits_step(model, ids).concat(), ref(ids).logits


@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_forward_only_step_gives_hf_logits(schedule):
    for got, want in harness.run(2, _forward_only, schedule):  # every rank gets the last stage's outputs
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance(want))


def _failing_stage(fail: bool):
    """A step whose last stage (on rank 1, its second stage) raises; then the model called
    outside a step. Returns both errors seen on this rank."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "random_seed": 1, **V})
    model = smp.DistributedModel(build("gpt2"))

    @smp.step
    def step(ids):
        out = model(ids, labels=ids)
        if fail:
            raise KeyError("the loss went missing")
        model.backward(out.loss)
        return out.loss

    errors = []
    try:
        step(global_batch(0))
        errors.append(None)
    except smp.pipeline.StepFailed as e:
        errors.append(str(e))
    try:
        model(global_batch(0))
        errors.append(None)
    except RuntimeError as e:
        errors.append(str(e))
    return errors


def test_failure_on_a_virtual_stage_ends_every_rank():
    """The code after the model call runs on the last stage only: its error reaches both ranks,
    which then still run a healthy step; a call outside ``@smp.step`` is refused on both."""
    for failed, outside in harness.run(2, _failing_stage, True):
        assert failed and "pipeline stage 1): KeyError: 'the loss went missing'" in failed, failed
        assert outside and "runs inside an @smp.step function" in outside, outside
    assert [e[0] for e in harness.run(2, _failing_stage, False)] == [None, None], "the ranks went on"


@pytest.mark.parametrize("extra, error, words", [
    ({"microbatches": 5}, ValueError, ["microbatches 5", "pipeline_parallel_degree 2", "2 equal rounds"]),
    ({"microbatches": 8, "active_microbatches": 5}, ValueError, ["a schedule of 5 microbatches"]),
    ({"pipeline_parallel_degree": 1}, ValueError, ["needs pipeline_parallel_degree > 1"]),
    ({"auto_partition": False}, NotImplementedError, ["auto_partition false"]),
])
def test_what_the_schedule_cannot_run_is_refused_at_init(extra, error, words):
    """Refused while the config is built, before any collective, naming the numbers (5
    microbatches at pp 2 are 2 rounds of unequal size for the interleaved schedule)."""
    with pytest.raises(error) as info:
        build_config({"pipeline_parallel_degree": 2, "microbatches": 4, **V, **extra}, 2)
    assert all(w in str(info.value) for w in words), str(info.value)
    build_config({"pipeline_parallel_degree": 2, "microbatches": 5, "pipeline": "simple", **V}, 2)  # any count


def _save(path, pp, virtual):
    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "random_seed": 1,
              "pipeline_virtual_stages": virtual})
    torch.manual_seed(1)
    model = smp.DistributedModel(build("gpt2"))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        train_step(model, my_rows(global_batch(step)))
        opt.step()
        opt.zero_grad()
    smp.save_checkpoint(path, tag="p", model=model, optimizer=opt)
    smp.save_checkpoint(path, tag="f", partial=False, model=model)
    return {k: v.clone() for k, v in model.state_dict().items()}, _next_loss(model, opt)


def _next_loss(model, opt):
    loss = train_step(model, my_rows(global_batch(2))).reduce_mean()
    opt.step()
    return sum(smp.allgather(loss, smp.DP_GROUP)).item() / smp.dp_size()


def _resume(path, pp, virtual, tag):
    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "random_seed": 7, "pipeline_virtual_stages": virtual})
    torch.manual_seed(7)
    model = smp.DistributedModel(build("gpt2"))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    smp.resume_from_checkpoint(path, tag=tag, partial=tag == "p")  # "f": weights only
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    return loaded, _next_loss(model, opt)  # the loss comes before the optimizer's step


@pytest.mark.parametrize("load_pp, load_virtual", [(2, 1), (1, 1), (2, 2)])
def test_checkpoint_with_virtual_stages_resumes_without(tmp_path, load_pp, load_virtual):
    """Saved at pp 2 x 2 virtual stages on 2 ranks (ranks hold layers {0, 2} and {1, 3}); resumed
    at pp 2 without virtual stages ({0, 1}, {2, 3}), at pp 1 (data parallelism) and with them
    again: the same weights and the same next step, from the partial and the full checkpoint."""
    saved, want = harness.run(2, _save, str(tmp_path), 2, 2)[0]
    assert torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"])
    for tag in ("p", "f"):
        loaded, loss = harness.run(2, _resume, str(tmp_path), load_pp, load_virtual, tag)[0]
        assert set(loaded) == set(saved) and all(torch.equal(saved[k], loaded[k]) for k in saved), tag
        assert abs(loss - want) <= training_rtol(2) * abs(want), (tag, loss, want)
