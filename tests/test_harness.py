"""The harness itself: results come back per rank and a failing rank fails the test."""

import pytest
import torch.distributed as dist

import harness


def _rank_and_sum():
    import torch
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    return "fine"


def test_results_per_rank():
    assert harness.run(2, _rank_and_sum) == [(0, 2.0), (1, 2.0)]


def test_failure_names_rank():
    with pytest.raises(AssertionError, match="(?s)rank 1:.*boom on rank 1"):
        harness.run(2, _fail_on_rank1)
    assert harness.run(2, _rank_and_sum) == [(0, 2.0), (1, 2.0)]
