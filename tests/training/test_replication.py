"""``smp.state.ranker``: which ranks hold the same data under FSDP (replication groups).

A failure of the grid tests means ``training/replication.py`` groups the wrong ranks: a local
(per-shard) checkpoint would then be shared by ranks holding different shards, or a sharded
checkpoint written by ranks that are not one complete copy. The held-data tests build the FSDP
layout a v2 script gets (its own FSDP1 call after ``init``/``transform``) at context parallelism
2 and expert parallelism 2 and group the ranks by the tensors they actually hold: a failure
there means the ranker disagrees with FSDP's real placement (context-parallel ranks left out of
the shard groups, or ranks holding different experts put in one group). The multi-rank state
test checks the ``state`` attributes v2 scripts read against the running mesh.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor
from transformers import MixtralConfig, MixtralForCausalLM

import harness
import modelparallel as smp
from modelparallel.config import build_config
from modelparallel.expert.config import MoEConfig
from modelparallel.runtime import mesh_layout
from modelparallel.training.replication import Ranker


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


def test_context_parallel_ranks_are_shard_group_members():
    # DP=2 x CP=2 (cluster: rank = 2 dp + cp): FSDP shards over all four in the order dp, cp;
    # shard groups of 2 are {0,1} and {2,3}, so 0 and 2 hold the same half; degree 1 replicates all
    r = Ranker(grid(4, context_parallel_degree=2), shard_degree=2)
    assert r.get_rep_groups() == [[0, 2], [1, 3]] and [r.get_rep_rank(k) for k in range(4)] == [0, 0, 1, 1]
    assert Ranker(grid(4, context_parallel_degree=2), shard_degree=1).get_rep_groups() == [[0, 1, 2, 3]]
    # "spread" (rank = 2 cp + dp): FSDP's order is 0, 2, 1, 3, so shard groups {0,2} and {1,3}
    r = Ranker(grid(4, context_parallel_degree=2, placement_strategy="spread"), shard_degree=2)
    assert r.get_rep_groups() == [[0, 1], [2, 3]] and [r.get_rep_rank(k) for k in range(4)] == [0, 1, 0, 1]


def test_expert_ranks_replicate_only_their_own_experts():
    # DP=4, EP=2: experts 0..1 on dp ranks 0 and 2, experts 2..3 on 1 and 3
    assert Ranker(grid(4), shard_degree=1, expert_degree=2).get_rep_groups() == [[0, 2], [1, 3]]
    assert Ranker(grid(4), shard_degree=2, expert_degree=2).get_rep_groups() == [[0, 2], [1, 3]]
    assert Ranker(grid(4), shard_degree=4, expert_degree=2).get_rep_groups() == [[0], [1], [2], [3]]
    r = Ranker(grid(8), shard_degree=1, expert_degree=2)
    assert r.get_rep_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [r.get_rep_rank(k) for k in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # rank 0's: one ep group


def test_experts_are_replicated_over_context_parallel_ranks():
    # DP=4 (EP=2 inside) x CP=2, cluster: rank = 2 dp + cp. Experts 0..1 on dp ranks 0 and 2 at
    # both cp ranks: ranks 0, 1, 4, 5; degree 1 replicates them there
    r = Ranker(grid(8, context_parallel_degree=2, expert_parallel_degree=2), shard_degree=1, expert_degree=2)
    assert r.get_rep_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [r.get_rep_rank(k) for k in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    # degree 4: dense shard groups {0..3}, {4..7}; experts in pairs of their 4 replicas ({0, 1}, {4, 5})
    r = Ranker(grid(8, context_parallel_degree=2, expert_parallel_degree=2), shard_degree=4, expert_degree=2)
    assert r.get_rep_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    r = Ranker(grid(8, context_parallel_degree=2, expert_parallel_degree=2), shard_degree=8, expert_degree=2)
    assert r.get_rep_groups() == [[k] for k in range(8)]


def test_tensor_and_context_parallel_ranks():
    # TP=2 x CP=2 x DP=2 (cluster: rank = 4 dp + 2 cp + tp), hybrid 2: shard groups per tp rank are
    # the cp pair of one dp rank, replicated over dp
    r = Ranker(grid(8, tensor_parallel_degree=2, context_parallel_degree=2), shard_degree=2)
    assert r.get_rep_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [r.get_shard_rank(k) for k in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


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


# ---- the groups FSDP's real placement makes ------------------------------------------------

def dense_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def mixtral():
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
                           max_position_embeddings=16)
    return smp.transform(MixtralForCausalLM(config), config=MoEConfig())


def held_groups(config: dict, build) -> dict:
    """FSDP1-wrap ``build()`` as a v2 script does under ``config``; return the groups of ranks
    holding equal tensors (every parameter's local shard) and what the ranker says."""
    smp.init(config)
    model = FSDP(build(), device_id=torch.device("cpu"))
    mine = [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    same = [[j for j, other in enumerate(every) if len(other) == len(held)
             and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(held, other))]
            for held in every]
    ranker = smp.state.ranker
    return dict(held=sorted(map(list, {tuple(g) for g in same})), groups=ranker.get_rep_groups(),
                rep_ranks=[ranker.get_rep_rank(k) for k in range(dist.get_world_size())])


def check_groups(out):
    for info in out:
        assert info["groups"] == info["held"], info
        for group in info["held"]:  # replication rank 0: exactly one per group, the copies numbered 0..n-1
            assert sorted(info["rep_ranks"][k] for k in group) == list(range(len(group))), info


def held_under(configs, build):
    return [held_groups(c, build) for c in configs]


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_context_parallel_groups_match_fsdp_placement(placement):
    configs = [{"context_parallel_degree": 2, "hybrid_shard_degree": n, "placement_strategy": placement}
               for n in (0, 1, 2)]
    for out in zip(*harness.run(4, held_under, configs, dense_model)):
        check_groups(out)


@pytest.mark.parametrize("cp", [1, 2])
def test_expert_parallel_groups_match_fsdp_placement(cp):
    configs = [{"expert_parallel_degree": 2, "context_parallel_degree": cp, "hybrid_shard_degree": n}
               for n in (0, 1, 2)]
    for out in zip(*harness.run(4, held_under, configs, mixtral)):
        check_groups(out)
