"""A failure on one pipeline stage ends every rank with the error, promptly, never a hang.

Each case makes one stage fail inside ``@smp.step`` (the user's function raising on the last
stage only, the first stage's forward failing, a bad microbatch shape) and checks that every
rank raises ``StepFailed`` naming the stage and the original error, within the harness's
after-error wait (a rank still waiting in a point-to-point receive would leave the pool broken).
Calling the model outside ``@smp.step`` is refused on every stage, and so is v2's ``transform``.

A hang or a missing error means modelparallel/pipeline/runner.py no longer keeps the schedule
going after a failure (zeros of the expected shapes), or pipeline/outputs.py no longer agrees on
failures over the pipeline group and the world.
"""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp


def model_for(pp: int, microbatches: int, schedule: str = "interleaved"):
    smp.init({"pipeline_parallel_degree": pp, "microbatches": microbatches, "pipeline": schedule})
    torch.manual_seed(0)
    return smp.DistributedModel(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=4, n_head=2, vocab_size=32,
                                                           n_positions=8)))


def fails(where: str, pp: int, microbatches: int, schedule: str):
    """Run a step in which ``where`` goes wrong; return this rank's error text (or None), and
    whether a later healthy step on a fresh runtime works (the ranks are all still in step)."""
    model = model_for(pp, microbatches, schedule)

    @smp.step
    def train_step(ids):
        if where == "user" and smp.pp_rank() == smp.pp_size() - 1:
            raise KeyError("the loss went missing")
        out = model(ids[:, :4] if where == "shape" and smp.pp_rank() == 0 else ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    ids = torch.randint(0, 32, (4, 8))
    if where == "first" and smp.pp_rank() == 0:
        model.module.transformer.h[0].mlp.c_fc.weight.data = torch.zeros(3, 3)  # a shape the forward refuses
    error = None
    try:
        train_step(ids)
    except smp.pipeline.StepFailed as e:
        error = str(e)
    return error


@pytest.mark.parametrize("where, pp, microbatches, schedule, fragment", [
    ("user", 2, 2, "interleaved", "pipeline stage 1): KeyError: 'the loss went missing'"),
    ("user", 4, 4, "interleaved", "pipeline stage 3): KeyError: 'the loss went missing'"),
    ("user", 2, 1, "simple", "pipeline stage 1): KeyError: 'the loss went missing'"),
    ("first", 2, 2, "simple", "pipeline stage 0): RuntimeError"),
])
def test_failure_on_one_stage_ends_every_rank(where, pp, microbatches, schedule, fragment):
    errors = harness.run(pp, fails, where, pp, microbatches, schedule)
    assert all(e is not None and fragment in e for e in errors), errors
    assert harness.run(pp, fails, "none", pp, microbatches, schedule) == [None] * pp, "the ranks went on"


def bad_shape_between_microbatches():
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32,
                                                            n_positions=8)))

    @smp.step
    def train_step(ids):
        if ids[0, 0].item() == 7:
            ids = ids[:, :4]
        out = model(ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    ids = torch.randint(0, 32, (4, 8))
    ids[:2, 0] = 1
    ids[2:, 0] = 7  # the second microbatch is cut to 4 positions: a different activation shape
    try:
        train_step(ids)
    except smp.pipeline.StepFailed as e:
        return str(e)
    return None


def test_microbatches_of_different_shapes_refused():
    errors = harness.run(2, bad_shape_between_microbatches)
    assert all("microbatch 1's activation has shape (2, 4, 16)" in e and "same shape" in e for e in errors), errors


def outside_step():
    model = model_for(2, 1)
    try:
        model(torch.zeros(2, 4, dtype=torch.long))
    except RuntimeError as e:
        return str(e)
    return None


def test_model_outside_step_refused():
    errors = harness.run(2, outside_step)
    assert all("runs inside an @smp.step function" in e for e in errors), errors


def transform_with_stages():
    smp.init({"pipeline_parallel_degree": 2})
    try:
        smp.transform(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=8)))
    except NotImplementedError as e:
        return str(e)
    return None


def test_transform_of_weights_tied_across_stages_refused():
    """GPT-2's wte and lm_head would live on two stages: refused by name, before any collective."""
    errors = harness.run(2, transform_with_stages)
    assert all("tied across stages (transformer.wte.weight = lm_head.weight)" in e for e in errors), errors
