"""A pipelined ``@smp.step`` takes its tensors from the first stage, as SageMaker feeds a pipeline.

SageMaker's v1 scripts give pipeline stages other than the first a dummy dataset of empty
tensors and tell them the loader's length with ``smp.broadcast(n, smp.PP_GROUP)`` on the first
stage and ``smp.recv_from(0, smp.RankType.PP_RANK)`` on the others. Each case feeds stages that
way and compares the losses of a few AdamW steps with one Hugging Face process on the whole batch.

A failure means modelparallel/pipeline/inputs.py (the first stage's tensors sent to the other
stages, their structure rebuilt around each stage's own non-tensor arguments) or its call in
modelparallel/step.py is wrong.
"""

import copy

import pytest
import torch

import harness
import modelparallel as smp
from modelparallel.pipeline.inputs import _Keep, _rebuild, _template
from reference import training_rtol
from test_pipeline_training import VOCAB, build, global_batch


@smp.step
def train_step(model, input_ids, attention_mask, labels):
    if smp.pp_rank() == 0:
        assert input_ids.numel() > 0
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    model.backward(out.loss)
    return out.loss


def batches(steps: int):
    """The loader a stage sees: real batches on the first stage, empty tensors elsewhere."""
    if smp.pp_rank() == 0:
        data = [global_batch(s).chunk(smp.dp_size())[smp.dp_rank()] for s in range(steps)]
        smp.broadcast(len(data), smp.PP_GROUP)
        return [(ids, torch.ones_like(ids), ids) for ids in data]
    count = smp.recv_from(0, smp.RankType.PP_RANK)
    empty = torch.empty(0, dtype=torch.long)
    return [(empty, empty, empty)] * count


def fed_from_first_stage(pp: int, tp: int, steps: int = 3):
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2,
              "pipeline": "interleaved", "random_seed": 1})
    torch.manual_seed(1)
    ref = build("gpt2")
    model = smp.DistributedModel(copy.deepcopy(ref))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step, (ids, mask, labels) in enumerate(batches(steps)):
        loss = train_step(model, ids, mask, labels).reduce_mean()
        mean = smp.allgather(loss, smp.DP_GROUP)
        opt.step()
        opt.zero_grad()
        whole = global_batch(step)
        ref_loss = ref(whole, labels=whole).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((sum(mean).item() / len(mean), ref_loss.item()))
    return losses


@pytest.mark.parametrize("world, pp, tp", [(2, 2, 1), (4, 2, 2)])
def test_other_stages_train_on_the_first_stages_batch(world, pp, tp):
    out = harness.run(world, fed_from_first_stage, pp, tp)
    for rank_losses in out:
        for step, (loss, want) in enumerate(rank_losses):
            assert abs(loss - want) <= training_rtol(step) * abs(want), (step, loss, want)


def test_structure_keeps_each_stages_own_non_tensors():
    """Tensors come from the first stage's structure; the model object, flags and missing
    entries are each stage's own."""
    model_here, model_there = object(), object()
    first = ((model_there, torch.arange(4)), {"mask": torch.ones(2), "flag": True, "extra": [torch.zeros(1), 3]})
    tensors = []
    template = _template(first, tensors)
    assert len(tensors) == 3
    mine = ((model_here, torch.empty(0)), {"mask": None, "flag": False})
    args, kwargs = _rebuild(template, mine, [t.clone() for t in tensors])
    assert args[0] is model_here and torch.equal(args[1], torch.arange(4))
    assert torch.equal(kwargs["mask"], torch.ones(2)) and kwargs["flag"] is False
    assert torch.equal(kwargs["extra"][0], torch.zeros(1)) and kwargs["extra"][1] is None
    assert isinstance(_template(3, []), _Keep)
