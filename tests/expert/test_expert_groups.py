"""Which ranks form an expert-parallel group: consecutive data-parallel ranks (the inner part of
the data-parallel dimension, as torchtitan and Megatron-Core carve expert parallelism out of data
parallelism), the same tensor-parallel rank; the expert replicas (EDP) differ only in the outer
part. A failure means modelparallel/runtime.py's ``expert_layout`` / ``GROUP_DIMS`` or
``Runtime.expert_mesh`` changed these groups, or broke the existing ones; or (the last test)
that the TP ranks of one expert-parallel rank no longer hold the same experts after wrap.
"""

import torch
import torch.distributed as dist

import harness
import modelparallel as smp
from modelparallel.config import build_config
from modelparallel.runtime import EXPERT_DIMS, GROUP_DIMS, expert_layout, members
from moe_reference import reference_model


def test_expert_groups_from_the_grid():
    """world 8 = tp 2 x dp 4, ep 2 ("cluster": dp index = rank // 2): EP pairs dp indices {0, 1}
    and {2, 3} at one tp rank; replicas pair dp indices {0, 2} and {1, 3}."""
    grid = expert_layout(build_config({"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, 8))
    assert grid.shape == (1, 2, 2, 1, 2)
    assert members(grid, GROUP_DIMS[smp.CommGroup.EP_GROUP], 0, EXPERT_DIMS) == [0, 2]
    assert members(grid, GROUP_DIMS[smp.CommGroup.EP_GROUP], 5, EXPERT_DIMS) == [5, 7]
    assert members(grid, GROUP_DIMS[smp.CommGroup.EDP_GROUP], 0, EXPERT_DIMS) == [0, 4]
    assert members(grid, ("edp", "ep"), 3, EXPERT_DIMS) == [1, 3, 5, 7], "edp x ep is the rdp group"
    spread = expert_layout(build_config({"tensor_parallel_degree": 2, "expert_parallel_degree": 2,
                                         "placement_strategy": "spread"}, 8))
    assert members(spread, GROUP_DIMS[smp.CommGroup.EP_GROUP], 0, EXPERT_DIMS) == [0, 1]


def live_groups():
    smp.init({"tensor_parallel_degree": 2, "expert_parallel_degree": 2})
    rt = smp.runtime.current()
    ep = [torch.zeros(1) for _ in range(smp.state.ep_size)]
    dist.all_gather(ep, torch.tensor([float(smp.rank())]), group=smp.state.ep_process_group)
    return dict(ep=(smp.state.ep_rank, smp.state.ep_size), members=[int(t.item()) for t in ep],
                mesh=rt.ep_mesh.mesh.tolist(), edp=rt.edp_mesh.mesh.tolist(), rdp=smp.get_rdp_group(),
                tp=smp.get_tp_group())


def test_live_groups_at_ep2_tp2():
    for r, info in enumerate(harness.run(4, live_groups)):
        pair = [r % 2, r % 2 + 2]
        assert info["ep"] == (r // 2, 2) and info["members"] == pair == info["mesh"], info
        assert info["edp"] == [r] and info["rdp"] == pair and info["tp"] == [r - r % 2, r - r % 2 + 1], info


def wrap_seeded_per_tp_rank():
    """SageMaker's scripts seed each TP rank differently before building the model."""
    smp.init({"expert_parallel_degree": 2, "tensor_parallel_degree": 2})
    built = reference_model("mixtral", seed=100 + smp.tp_rank())
    mine = slice(smp.state.ep_rank * 2, smp.state.ep_rank * 2 + 2)  # 4 experts, 2 per ep rank
    before = built.model.layers[0].mlp.experts.gate_up_proj.detach()[mine].clone()
    model = smp.DistributedModel(built)
    after = model.module.model.layers[0].mlp.experts.gate_up_proj.to_local().detach().clone()
    return smp.tp_rank(), smp.state.ep_rank, before, after


def test_experts_are_tp_rank0s_after_wrap():
    """E=2 x T=2: the TP ranks of a pair hold the same experts, so they must hold TP rank 0's
    (fails without experts in tp_sync's replicated tensors: TP rank 1 keeps its own draw)."""
    runs = harness.run(4, wrap_seeded_per_tp_rank)
    for tp0, tp1 in ((runs[0], runs[1]), (runs[2], runs[3])):
        assert tp0[:2] == (0, tp1[1]) and tp1[0] == 1, (tp0[:2], tp1[:2])
        assert not torch.equal(tp0[2], tp1[2]), "the TP ranks drew the same experts: the test proves nothing"
        assert torch.equal(tp0[3], tp0[2]), "TP rank 0's experts changed"
        assert torch.equal(tp1[3], tp0[2]), "TP rank 1's experts are not TP rank 0's"
