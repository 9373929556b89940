"""Activation checkpointing the ways Hugging Face and PyTorch scripts enable it, under v1's
pipeline parallelism (``smp.DistributedModel`` + ``@smp.step``): gradients and losses equal one
Hugging Face process with the same checkpointing on the global batch.

The forms: HF's ``gradient_checkpointing_enable()`` (reentrant or not) and PyTorch's
``apply_activation_checkpointing`` (``CheckpointWrapper`` around each block, non-reentrant or
reentrant), each applied before or after ``smp.DistributedModel``; SageMaker's
``smp.set_activation_checkpointing`` is in test_pipeline_compose.py. A failure here means the
hooks at a stage's edges (modelparallel/pipeline/stage.py ``Boundary``) sit inside the
checkpointed region: the received activation is swapped in again, or the stage exits, while
backward recomputes the first or last block.
"""

import copy
import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp
from reference import training_rtol
from test_pipeline_training import assert_stage_grads_match, build, global_batch, my_rows, train_step


def checkpoint(model, form: str) -> None:
    """Checkpoint every block of ``model`` (an HF model, or a DistributedModel) in ``form``."""
    kind, _, variant = form.partition("-")
    if kind == "hf":
        kwargs = None if variant == "default" else {"use_reentrant": variant == "reentrant"}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    impl = CheckpointImpl.REENTRANT if variant == "reentrant" else CheckpointImpl.NO_REENTRANT
    hf = model.module if isinstance(model, smp.DistributedModel) else model
    apply_activation_checkpointing(hf, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, LlamaDecoderLayer))


def checkpointed_steps(form: str, when: str, config: dict):
    """One step's gradients, and two steps' losses (the second on another batch, gradients
    accumulating), equal HF's with the same checkpointing."""
    smp.init({"microbatches": 2, "pipeline": "interleaved", "random_seed": 1, **config})
    torch.manual_seed(1)
    ref = build("llama")
    ref.train()
    checkpoint(ref, form)
    if when == "before":
        model = smp.DistributedModel(copy.deepcopy(ref))
    else:
        model = smp.DistributedModel(copy.deepcopy(build_like(ref)))
        checkpoint(model, form)
    losses = []
    for step in range(2):
        ids = global_batch(step)
        want = ref(ids, labels=ids).loss
        want.backward()
        got = train_step(model, my_rows(ids)).reduce_mean()
        mean = smp.allgather(got, smp.DP_GROUP)
        losses.append((sum(mean).item() / len(mean), want.item()))
        if step == 0:
            assert_stage_grads_match(ref, model, ids)
    return losses


def build_like(ref):
    """An unwrapped model with ``ref``'s weights (``ref`` may hold checkpoint wrappers)."""
    torch.manual_seed(1)
    plain = build("llama")
    plain.load_state_dict(ref.state_dict())
    return plain


FORMS = ["hf-default", "hf-reentrant", "hf-nonreentrant", "torch-nonreentrant", "torch-reentrant"]


def _assert_losses(out):
    for step, (loss, want) in enumerate(out[0]):
        assert abs(loss - want) <= training_rtol(0) * abs(want), (step, loss, want)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("form", FORMS)
def test_checkpointed_pipeline_equals_one_process(form, when):
    _assert_losses(harness.run(2, checkpointed_steps, form, when, {"pipeline_parallel_degree": 2}))


@pytest.mark.parametrize("form", ["hf-default", "torch-nonreentrant"])
def test_checkpointed_virtual_stages_equal_one_process(form):
    _assert_losses(harness.run(2, checkpointed_steps, form, "after",
                               {"pipeline_parallel_degree": 2, "pipeline_virtual_stages": 2}))
