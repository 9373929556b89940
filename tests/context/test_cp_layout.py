"""The load-balanced split (modelparallel/context/layout.py, smp.get_batch_for_cp_rank,
smp.gather_sequence) and the context-parallel groups and meshes of the runtime.

A failure in the one-process tests means layout.py puts a token in the wrong chunk: the model
would then see wrong positions and masks. A failure in ``test_groups_and_meshes`` means
runtime.py lays the "cp" dimension out differently from SageMaker v2 (data-parallel rank =
global rank // (tp x cp), tp fastest, then cp), or ``dp_mesh()`` (what FSDP shards over) does
not span the data x context ranks.
"""

import pytest
import torch
import torch.distributed as dist

import harness
import modelparallel as smp
from modelparallel.context import layout
from modelparallel.runtime import GROUP_DIMS, members, mesh_layout
from modelparallel.config import build_config


def test_split_holds_chunks_r_and_2c_minus_1_minus_r():
    tokens = torch.arange(16).unsqueeze(0)
    assert layout.split(tokens, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert layout.split(tokens, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert layout.split(tokens, 4, 1).tolist() == [[2, 3, 12, 13]]
    for size in (1, 2, 4):
        for rank in range(size):
            assert torch.equal(layout.positions(16 // size, size, rank), layout.split(tokens, size, rank)[0])


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_split_and_merge_round_trip(size):
    hidden = torch.randn(2, 4 * size * 3, 5)  # [B, S, H]: the sequence on dim 1
    parts = [layout.split(hidden, size, r) for r in range(size)]
    assert all(p.shape == (2, 12, 5) for p in parts)
    assert torch.equal(layout.merge(parts), hidden)
    heads = torch.randn(2, 3, 4 * size, 8)  # [B, H, S, D]
    assert torch.equal(layout.merge([layout.split(heads, size, r, seq_dim=2) for r in range(size)], seq_dim=2), heads)


def test_split_refuses_a_length_not_divisible_by_2c():
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by 2 x context_parallel_degree = 4"):
        layout.split(torch.zeros(1, 10), 2, 0)


def test_layout_grid_puts_cp_between_dp_and_tp():
    grid = mesh_layout(build_config({"tensor_parallel_degree": 2, "context_parallel_degree": 2}, 8))
    assert grid.shape == (1, 2, 2, 2)  # [pp, dp, cp, tp]
    assert grid[0, 1, 0].tolist() == [4, 5] and grid[0, 0, 1].tolist() == [2, 3]
    assert members(grid, GROUP_DIMS[smp.CP_GROUP], 5) == [5, 7]
    assert members(grid, GROUP_DIMS[smp.DP_CP_GROUP], 5) == [1, 3, 5, 7]
    assert members(grid, GROUP_DIMS[smp.RDP_GROUP], 5) == [1, 5]


def _info(tp):
    smp.init({"context_parallel_degree": 2, "tensor_parallel_degree": tp})
    batch = smp.get_batch_for_cp_rank((torch.arange(8).unsqueeze(0), None, torch.arange(8).unsqueeze(0) + 100))
    whole = smp.gather_sequence(batch[0])
    return dict(cp=(smp.cp_rank(), smp.cp_size()), state=(smp.state.cp_rank, smp.state.cp_size,
                                                           smp.state.context_parallel_degree),
                cp_group=smp.get_cp_group(), cp_pg=dist.get_process_group_ranks(smp.state.cp_process_group),
                rdp=smp.get_rdp_group(), dp_mesh=smp.dp_mesh().mesh.tolist(), cp_mesh=smp.cp_mesh().mesh.tolist(),
                batch=[None if t is None else t.tolist() for t in batch], whole=whole.tolist(),
                dp_state=(smp.state.dp_rank, smp.state.dp_size))


@pytest.mark.parametrize("tp", [1, 2])
def test_groups_and_meshes(tp):
    out = harness.run(4, _info, tp)
    for rank, info in enumerate(out):
        cp_rank = (rank // tp) % 2
        cp_group = [r for r in range(4) if r % tp == rank % tp and r // (2 * tp) == rank // (2 * tp)]
        assert info["cp"] == (cp_rank, 2) and info["state"] == (cp_rank, 2, 2)
        assert info["cp_group"] == info["cp_pg"] == info["cp_mesh"] == cp_group
        dp = rank // (tp * 2)  # SageMaker v2: data-parallel rank = global rank // (tp x cp)
        assert info["dp_state"] == (dp, 4 // (2 * tp))
        assert info["dp_mesh"] == [r for r in range(4) if r % tp == rank % tp]  # data x context ranks
        first, second = (cp_rank, 3 - cp_rank)
        assert info["batch"][0] == [[2 * first, 2 * first + 1, 2 * second, 2 * second + 1]]
        assert info["batch"][1] is None and info["batch"][2][0][0] == 100 + 2 * first
        assert info["whole"] == [list(range(8))]
