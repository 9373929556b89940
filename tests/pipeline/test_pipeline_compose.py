"""Pipeline parallelism composed with activation checkpointing (and offloading), sharded data
parallelism (FSDP2 over the data-parallel ranks of each stage) and ``shard_optimizer_state``:
gradients and AdamW losses equal one Hugging Face process.

A failure with checkpointing means the stage's edge hooks (pipeline/stage.py) run again, or not
at all, when a checkpointed layer is recomputed; with sharding, that FSDP2's hooks and the stage
exit (a raise after the stage's last block) do not compose (gradients not reduce-scattered).
"""

import copy

import pytest
import torch

import harness
import modelparallel as smp
from reference import training_rtol
from test_pipeline_training import (adamw_steps, assert_stage_grads_match, build, global_batch, my_rows,
                                    setup, train_step)


def _checkpointed(offload):
    ref, model = setup("gpt2", 2, 1, 2, "interleaved", offload_activations=offload)
    smp.set_activation_checkpointing(model.module.transformer.h)
    ids = global_batch(0)
    ref(ids, labels=ids).loss.backward()
    train_step(model, my_rows(ids))
    assert_stage_grads_match(ref, model, ids)
    return True


@pytest.mark.parametrize("offload", [False, True])
def test_activation_checkpointing_on_each_stage(offload):
    assert harness.run(2, _checkpointed, offload) == [True, True]


def _sharded(keys):
    ref, model = setup("gpt2", 2, 1, 2, "interleaved", **keys)
    ids = global_batch(0)
    ref(ids, labels=ids).loss.backward()
    train_step(model, my_rows(ids))
    assert_stage_grads_match(ref, model, ids)
    return True


@pytest.mark.parametrize("keys", [{"sharded_data_parallel_degree": 2}, {"shard_optimizer_state": True}])
def test_sharded_data_parallel_per_stage(keys):
    assert harness.run(4, _sharded, keys) == [True] * 4


def test_shard_optimizer_state_adamw_steps():
    out = harness.run(4, adamw_steps, "gpt2", 2, 1, 2, "simple", 3, shard_optimizer_state=True)
    for step, (loss, want) in enumerate(out[0][0]):
        assert abs(loss - want) <= training_rtol(step) * abs(want), (step, loss, want)
