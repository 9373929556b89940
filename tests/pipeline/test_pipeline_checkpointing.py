"""Activation checkpointing the ways Hugging Face and PyTorch scripts enable it, under v1's
pipeline parallelism (``smp.DistributedModel`` + ``@smp.step``): gradients and losses equal one
Hugging Face process with the same checkpointing on the global batch.

The forms: HF's ``activation_checkpointing_enable()`` and ``gradient_checkpointing_enable(...)``
(reentrant or not) and PyTorch's ``apply_activation_checkpointing`` (``CheckpointWrapper`` around
each block, non-reentrant or reentrant), each applied before or after ``smp.DistributedModel``, at
pp 2 on 2 ranks, with virtual stages, and pp 2 x sharded dp 2 on 4; SageMaker's
``smp.set_activation_checkpointing`` is in test_pipeline_compose.py. Each case also counts that
every local block's region runs twice per microbatch (checkpointing is on) and that PyTorch's
wrappers are still around the blocks.

A failure of an "after" case means the hooks at a stage's edges (modelparallel/pipeline/stage.py
``Boundary``) sit inside the checkpointed region: the received activation is swapped in again,
or the stage exits, while backward recomputes the first or last block. A "before" case failing
alone points at modelparallel/activations/wrappers.py (the wrappers set aside while
``DistributedModel`` parallelizes, and put back).
"""

import copy
import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, CheckpointWrapper,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper, offload_wrapper)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp
from modelparallel.activations.wrappers import lifted
from reference import count_block_runs, training_rtol
from test_pipeline_training import assert_stage_grads_match, build, global_batch, my_rows, train_step

MICROBATCHES = 2


def checkpoint(model, form: str) -> None:
    """Checkpoint every block of ``model`` (an HF model, or a DistributedModel) in ``form``."""
    kind, _, variant = form.partition("-")
    if kind == "hf":
        if variant == "default":  # transformers 5's name (non-reentrant unless told)
            model.activation_checkpointing_enable()
        else:  # the older name, still what most scripts call
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": variant == "reentrant"})
        return
    impl = CheckpointImpl.REENTRANT if variant == "reentrant" else CheckpointImpl.NO_REENTRANT
    hf = model.module if isinstance(model, smp.DistributedModel) else model
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    apply_activation_checkpointing(hf, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: isinstance(m, LlamaDecoderLayer))


def checkpointed_steps(form: str, when: str, config: dict, partitions: tuple[int, ...] = ()):
    """One step's gradients, and two steps' losses (the second on another batch, gradients
    accumulating), equal HF's with the same checkpointing. ``partitions``: each block's
    ``smp.set_partition`` after DistributedModel (on the list's entries, wrappers or blocks)."""
    smp.init({"microbatches": MICROBATCHES, "pipeline": "interleaved", "random_seed": 1, **config})
    torch.manual_seed(1)
    ref = build("llama")
    ref.train()
    checkpoint(ref, form)
    if when == "before":
        model = smp.DistributedModel(copy.deepcopy(ref))
    else:
        model = smp.DistributedModel(copy.deepcopy(build_like(ref)))
        checkpoint(model, form)
    for entry, index in zip(model.module.model.layers, partitions):
        smp.set_partition(entry, index)
    runs = count_block_runs(model.module)
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
    if partitions:
        marked = tuple((partitions.index(p), len(partitions) - partitions[::-1].index(p))
                       for p in sorted(set(partitions)))
        assert model.module._mp_stage.ranges == marked, (model.module._mp_stage.ranges, marked)
    wrapped = [type(m).__name__ for m in model.module.model.layers]
    assert form.startswith("hf") or set(wrapped) == {"CheckpointWrapper"}, wrapped
    local = {n: runs[n] for n, _ in model.module.named_modules() if n in runs}  # counted before a deferred split
    assert local and all(n == 2 * 2 * MICROBATCHES for n in local.values()), runs  # 2 steps, forward + recompute
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


def test_checkpointed_pipeline_with_sharded_data_parallelism():
    """pp 2 x sharded dp 2: PyTorch's wrappers applied before DistributedModel end up around
    the FSDP2-sharded blocks, the stage edges on the wrappers."""
    _assert_losses(harness.run(4, checkpointed_steps, "torch-nonreentrant", "before",
                               {"pipeline_parallel_degree": 2, "sharded_data_parallel_degree": 2}))


def test_wrapped_before_distributed_model_without_pipeline():
    """PyTorch's wrappers applied before DistributedModel at pp 1 x tp 2: the tensor-parallel
    plan finds the blocks' own paths, and the wrappers end up around the sharded blocks."""
    _assert_losses(harness.run(2, checkpointed_steps, "torch-reentrant", "before", {"tensor_parallel_degree": 2}))


def test_partition_marks_on_wrapped_blocks_place_them():
    """auto_partition false, ``smp.set_partition`` on the wrappers after DistributedModel (the
    split waits for the marks): layers 0-2 on stage 0, layer 3 on stage 1, as marked."""
    out = harness.run(2, checkpointed_steps, "torch-nonreentrant", "before",
                      {"pipeline_parallel_degree": 2, "auto_partition": False}, partitions=(0, 0, 0, 1))
    _assert_losses(out)


def test_wrappers_are_set_aside_and_put_back():
    """``lifted``: nested wrappers come off for the duration and go back in their order around
    what is then in their place; none around a block removed meanwhile (the pipeline split)."""
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    apply_activation_checkpointing(layers, check_fn=lambda m: isinstance(m, torch.nn.Linear))
    layers[0] = offload_wrapper(layers[0])
    wrappers = list(layers)
    replaced = torch.nn.Linear(2, 2)
    with lifted(layers):
        assert all(type(m) is torch.nn.Linear for m in layers)
        layers[1] = replaced
        del layers._modules["2"]
    assert list(layers) == wrappers[:2] and len(layers) == 2
    assert isinstance(layers[0]._checkpoint_wrapped_module, CheckpointWrapper)
    assert layers[1]._checkpoint_wrapped_module is replaced


def test_a_wrapped_model_is_refused():
    model = checkpoint_wrapper(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="CheckpointWrapper .*wrap what smp.DistributedModel returns"):
        with lifted(model):
            pass


def _decoder_checkpointed():
    """One checkpointed region around a stage's whole decoder (its blocks inside): the
    recompute in backward would run the stage's edges again."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "random_seed": 1})
    torch.manual_seed(1)
    model = smp.DistributedModel(build("llama"))
    smp.set_activation_checkpointing(model.module.model)
    with pytest.raises(smp.pipeline.StepFailed) as failed:
        train_step(model, my_rows(global_batch(0)))
    return str(failed.value).splitlines()[0]


def test_a_region_around_several_blocks_fails_on_every_rank():
    for message in harness.run(2, _decoder_checkpointed):
        assert "an activation checkpoint around several blocks" in message and "checkpoint each block" in message
