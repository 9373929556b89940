"""Which layers each pipeline stage gets, and the checks that refuse a bad layout, in one process.

A failure in the ``balanced`` tests means the automatic partitioner (modelparallel/pipeline/
partition.py) no longer balances by cost or no longer keeps uniform layers within one of even;
in the manual tests, that ``smp.partition`` / ``smp.set_partition`` marks (pipeline/marks.py)
are read wrongly or a bad layout is accepted; in the config tests, that config.py lets a bad
pipeline key through, or parallelize.check a pipeline with context parallelism.
"""

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import modelparallel as smp
from modelparallel.config import build_config
from modelparallel.models import architecture_for
from modelparallel.pipeline import plan_ranges
from modelparallel.pipeline.placement import balanced, imbalance


@pytest.mark.parametrize("layers, stages", [(8, 2), (8, 4), (10, 4), (7, 3), (13, 4), (4, 4), (24, 8)])
@pytest.mark.parametrize("first, last", [(0, 0), (50, 0), (0, 50), (50, 50)])
def test_uniform_layers_within_one_of_even(layers, stages, first, last):
    ranges = balanced([10] * layers, stages, first, last)
    sizes = [hi - lo for lo, hi in ranges]
    assert sum(sizes) == layers and ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
    assert max(sizes) - min(sizes) <= 1, sizes


def test_extra_layers_go_to_stages_without_embeddings_or_head():
    sizes = lambda ranges: [hi - lo for lo, hi in ranges]
    assert sizes(balanced([1] * 10, 4, first=5))[0] == 2
    assert sizes(balanced([1] * 10, 4, last=5))[-1] == 2
    assert sizes(balanced([1] * 10, 4, first=5, last=5)) == [2, 3, 3, 2]
    assert balanced([1] * 7, 2, first=100)[0] == (0, 3)


def test_unequal_layers_balanced_by_cost():
    costs = [5, 1, 1, 1, 1, 5]
    ranges = balanced(costs, 2)
    assert ranges == ((0, 3), (3, 6)) and imbalance(costs, ranges) == 1.0
    assert balanced([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == ((0, 1), (1, 9))


def tiny(layers=4):
    return GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=layers, n_head=2, vocab_size=32, n_positions=8))


def cfg(**keys):
    return build_config({"pipeline_parallel_degree": 2, **keys}, 2)


def test_manual_marks_and_default_partition():
    model = tiny(4)
    split = architecture_for(model).pipeline
    for i, block in enumerate(model.transformer.h):
        smp.set_partition(block, 0 if i < 3 else 1)
    assert plan_ranges(model, split, 2, auto=False, default=0) == ((0, 3), (3, 4))
    assert plan_ranges(model, split, 2, auto=True, default=0) == ((0, 2), (2, 4)), "marks ignored when auto"


def test_partition_context_innermost_wins():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with smp.partition(1):
                self.a = nn.Linear(2, 2)
                with smp.partition(2):
                    self.b = nn.Linear(2, 2)
                self.c = nn.Linear(2, 2)
            self.d = nn.Linear(2, 2)

    net = Net()
    got = {n: smp.pipeline.partition_of(net, n, 0) for n in ("a", "b", "c", "d")}
    assert got == {"a": (1, True), "b": (2, True), "c": (1, True), "d": (0, False)}


def test_set_partition_on_a_parent_applies_to_its_blocks():
    model = tiny(4)
    smp.set_partition(model.transformer, 1)
    smp.set_partition(model.transformer.h[0], 0)
    assert plan_ranges(model, architecture_for(model).pipeline, 2, auto=False, default=0) == ((0, 1), (1, 4))


@pytest.mark.parametrize("marks, fragment", [
    ([0, 1, 0, 1], "transformer.h.2 is on partition 0 after transformer.h.1 on partition 1"),
    ([0, 0, 0, 0], r"partitions \[1\] get no layer"),
    ([0, 0, 1, 3], "transformer.h.3 is on partition 3, but pipeline_parallel_degree is 2"),
])
def test_bad_manual_partitions_named(marks, fragment):
    model = tiny(4)
    for block, index in zip(model.transformer.h, marks):
        smp.set_partition(block, index)
    with pytest.raises(ValueError, match=fragment):
        plan_ranges(model, architecture_for(model).pipeline, 2, auto=False, default=0)


def test_more_stages_than_layers_refused():
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree 4 is more than the 2 layers of GPT2LMHeadModel"):
        plan_ranges(tiny(2), architecture_for(tiny(2)).pipeline, 4, auto=True, default=0)


def test_bad_partition_arguments():
    with pytest.raises(ValueError, match="a partition index is an integer >= 0, got -1"):
        smp.set_partition(nn.Linear(2, 2), -1)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        smp.set_partition(torch.zeros(2), 0)
    with pytest.raises(ValueError, match="a partition index is an integer >= 0, got 'x'"):
        with smp.partition("x"):
            pass


def test_pipeline_config_keys():
    assert cfg(pipeline="simple", microbatches=4, active_microbatches=2).pipeline == "simple"
    with pytest.raises(ValueError, match=r"pipeline must be one of \('interleaved', 'simple'\), got 'gpipe'"):
        cfg(pipeline="gpipe")
    with pytest.raises(ValueError, match="default_partition 2 is not a partition: pipeline_parallel_degree is 2"):
        cfg(default_partition=2)
    with pytest.raises(ValueError, match="world size 2 is not divisible by tensor_parallel_degree 2 x "
                                         "pipeline_parallel_degree 2 = 4"):
        cfg(tensor_parallel_degree=2)
    with pytest.raises(ValueError, match="active_microbatches must be >= 0"):
        cfg(active_microbatches=-1)
    assert build_config({"default_partition": 3}, 2).default_partition == 3, "no pipeline: nothing to check"


def test_pipeline_with_context_or_expert_parallelism_accepted_by_the_config():
    both = build_config({"pipeline_parallel_degree": 2, "context_parallel_degree": 2, "tensor_parallel_degree": 2}, 8)
    assert (both.pipeline_parallel_degree, both.context_parallel_degree) == (2, 2)
    assert build_config({"pipeline_parallel_degree": 2, "expert_parallel_degree": 2}, 4).expert_parallel_degree == 2
    for api in (None, "v2"):  # v1 runs stages through @smp.step, v2 a whole batch per call
        assert build_config({"pipeline_parallel_degree": 2}, 2, api=api).pipeline_parallel_degree == 2
