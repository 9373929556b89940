"""``smp.state.ranker``: which ranks hold the same shard under FSDP (replication groups).

A failure of the grid tests means ``training/replication.py`` groups the wrong ranks: a local
(per-shard) checkpoint would then be shared by ranks holding different shards, or a sharded
checkpoint written by ranks that are not one complete copy. The multi-rank test checks the
``state`` attributes v2 scripts read against the running mesh.
"""

import torch

import harness
import modelparallel as smp
from modelparallel.runtime import mesh_layout
from modelparallel.training.replication import Ranker
from modelparallel.config import build_config


def grid(world, **cfg):
    return mesh_layout(build_config(cfg, world))


def test_full_shard_every_rank_is_its_own_group():
    r = Ranker(grid(4, tensor_parallel_degree=2), shard_degree=2)
    assert r.get_rep_groups() == [[0], [1], [2], [3]]
    assert [r.get_rep_rank(k) for k in range(4)] == [0, 0, 0, 0]


def test_hybrid_two_of_four_pairs_across_shard_groups():
    # dp ranks 0..3 (TP=1), shard groups {0,1} and {2,3}: rank 0 and 2 hold the same half
    r = Ranker(grid(4), shard_degree=2)
    assert r.get_rep_groups() == [[0, 2], [1, 3]]
    assert [r.get_rep_rank(k) for k in range(4)] == [0, 0, 1, 1]
    assert [r.get_shard_rank(k) for k in range(4)] == [0, 1, 0, 1]


def test_no_shard_replicates_over_dp_per_tp_rank():
    # TP=2 x DP=4 (cluster: tp fastest), shard degree 1: each tp rank's dp ranks are copies
    r = Ranker(grid(8, tensor_parallel_degree=2), shard_degree=1)
    assert r.get_rep_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [r.get_rep_rank(k) for k in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_unknown_rank_refused():
    r = Ranker(grid(2), shard_degree=2)
    try:
        r.get_rep_rank(5)
    except ValueError as e:
        assert "rank 5" in str(e)
    else:
        raise AssertionError("rank 5 of a 2-rank job accepted")


def state_of_running_job():
    smp.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 1})
    s = smp.state
    return dict(groups=s.ranker.get_rep_groups(), rep_rank=s.ranker.get_rep_rank(),
                mine=s.ranker.get_rep_rank(smp.rank()), cp=(s.cp_rank, s.cp_size, s.context_parallel_degree),
                ep=(s.ep_rank, s.ep_size, s.expert_parallel_degree))


def test_state_attributes_of_a_running_job():
    out = harness.run(4, state_of_running_job)
    for rank, info in enumerate(out):
        assert info["groups"] == [[0, 2], [1, 3]]
        assert info["rep_rank"] == info["mine"] == rank // 2
        assert info["cp"] == (0, 1, 1) and info["ep"] == (0, 1, 1)
