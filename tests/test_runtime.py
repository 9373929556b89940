"""The runtime: rank API, mesh layout by placement strategy, groups, broadcast, bad configs.

A failure means modelparallel/runtime.py maps ranks to the (dp, tp) mesh wrongly or a group
getter returns the wrong ranks.
"""

import pytest
import torch
import torch.distributed as dist

import harness
import modelparallel as smp
from modelparallel.config import build_config
from modelparallel.runtime import mesh_layout


def test_mesh_layout_cluster_and_spread():
    assert mesh_layout(build_config({"tensor_parallel_degree": 2}, 4)).tolist() == [[0, 1], [2, 3]]
    spread = build_config({"tensor_parallel_degree": 2, "placement_strategy": "spread"}, 4)
    assert mesh_layout(spread).tolist() == [[0, 2], [1, 3]]


def _ranks(strategy):
    smp.init({"tensor_parallel_degree": 2, "placement_strategy": strategy})
    tp_members = [torch.zeros(1) for _ in range(smp.tp_size())]
    dist.all_gather(tp_members, torch.tensor([float(smp.rank())]), group=smp.get_tp_process_group())
    value = smp.broadcast({"from": smp.rank()}, smp.TP_GROUP)
    smp.barrier()
    return dict(rank=smp.rank(), size=smp.size(), tp=(smp.tp_rank(), smp.tp_size()),
                dp=(smp.dp_rank(), smp.dp_size()), rdp=(smp.rdp_rank(), smp.rdp_size()),
                mp=(smp.mp_rank(), smp.mp_size()), pp=(smp.pp_rank(), smp.pp_size()),
                local=(smp.local_rank(), smp.local_size()),
                tp_group=[int(t.item()) for t in tp_members], bcast=value["from"])


@pytest.mark.parametrize("strategy, groups", [("cluster", [[0, 1], [2, 3]]), ("spread", [[0, 2], [1, 3]])])
def test_rank_api(strategy, groups):
    out = harness.run(4, _ranks, strategy)
    for r, info in enumerate(out):
        group = next(g for g in groups if r in g)
        assert info["rank"] == r and info["size"] == 4
        assert info["tp"] == (group.index(r), 2) and info["mp"] == info["tp"]
        assert info["dp"] == (groups.index(group), 2) and info["rdp"] == info["dp"]
        assert info["pp"] == (0, 1) and info["local"] == (r, 4)
        assert info["tp_group"] == group
        assert info["bcast"] == group[0]


def _bad_init():
    try:
        smp.init({"tensor_parallel_degree": 3})
    except ValueError as e:
        return str(e)
    return None


def test_bad_config_raises_on_every_rank():
    for msg in harness.run(2, _bad_init):
        assert msg and "world size 2 is not divisible by tensor_parallel_degree 3" in msg


def test_rank_api_needs_init(monkeypatch):
    monkeypatch.setattr("modelparallel.runtime._RUNTIME", None)
    with pytest.raises(RuntimeError, match="call modelparallel.init"):
        smp.tp_rank()
