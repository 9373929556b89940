"""SageMaker's rank functions and groups at pipeline degree 2, on live ranks, against the
definitions: PP_GROUP = same tp and rdp rank (one rank per stage), MP_GROUP = the tp x pp ranks
of one model replica, DP_GROUP = same pp rank, RDP_GROUP = same tp and pp rank, TP_GROUP = same
pp and rdp rank; every placement order of D, P, T lays ranks out slowest letter first.

The expected groups are computed here from each rank's (d, p, t) coordinate alone; a failure
means modelparallel/runtime.py (``mesh_layout``, ``GROUP_DIMS``) disagrees with SageMaker's
definitions, or a group's process group does not connect its members.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

import harness
import modelparallel as smp


def coordinates(order: str, sizes: dict[str, int]) -> dict[int, dict[str, int]]:
    """Global rank -> {"D": d, "P": p, "T": t}: ranks count through ``order``, last letter fastest."""
    out = {}
    for rank, coord in enumerate(itertools.product(*(range(sizes[c]) for c in order))):
        out[rank] = dict(zip(order, coord))
    return out


SAME = {"tp": "DP", "pp": "DT", "rdp": "PT", "dp": "P", "mp": "D"}
"""Each group: the coordinates its members share."""


def _live(config):
    smp.init(config)
    got = {}
    for name in SAME:
        members = getattr(smp, f"get_{name}_group")()
        rank, size = getattr(smp, f"{name}_rank")(), getattr(smp, f"{name}_size")()
        pg = getattr(smp, f"get_{name}_process_group")()
        total = torch.tensor([float(smp.rank())])
        dist.all_reduce(total, group=pg)  # the process group connects exactly the members
        got[name] = (members, rank, size, int(total.item()))
    return got


@pytest.mark.parametrize("order", ["DPT", "DTP", "PDT", "TPD", "cluster", "spread"])
@pytest.mark.parametrize("tp", [1, 2])
def test_groups_follow_sagemaker_definitions(order, tp):
    world, pp = 4, 2
    sizes = {"P": pp, "T": tp, "D": world // (pp * tp)}
    letters = {"cluster": "DPT", "spread": "TPD"}.get(order, order)
    coords = coordinates(letters, sizes)
    out = harness.run(world, _live, {"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp,
                                     "placement_strategy": order})
    for rank, got in enumerate(out):
        for name, shared in SAME.items():
            want = sorted(r for r, c in coords.items() if all(c[k] == coords[rank][k] for k in shared))
            members, index, size, total = got[name]
            assert members == want, (name, rank, members, want)
            assert (index, size, total) == (want.index(rank), len(want), sum(want)), (name, rank)
    assert [got["pp"][1] for got in out] == [coords[r]["P"] for r in range(world)], "pp_rank() is the stage"
