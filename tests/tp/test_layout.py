"""Shard arithmetic (modelparallel/tp/layout.py) agrees with DTensor itself, uneven sizes included.

Every block, range and shard is checked against what ``distribute_tensor`` puts on each rank and
what ``full_tensor`` gathers, on 4 gloo ranks, for sizes that do not divide (GPT-2's vocabulary
50257 at TP=4; 6 rows on 4 ranks, where the last piece is empty) and on a 2-D mesh. A failure
means layout.py and DTensor disagree about which rows a rank holds: every loader, exporter and
the vocab-parallel loss would then read or write the wrong block.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

import harness
from modelparallel.tp import layout

CASES = [  # (global shape, mesh shape, placements)
    ((50257,), (4,), [Shard(0)]),  # GPT-2's vocabulary at TP=4: 12565 x 3 and 12562
    ((6,), (4,), [Shard(0)]),  # 2, 2, 2 and an empty piece
    ((3, 10), (4,), [Shard(1)]),
    ((5, 3), (4,), [Replicate()]),
    ((7, 9), (2, 2), [Shard(0), Shard(1)]),
    ((7, 9), (2, 2), [Replicate(), Shard(0)]),
]


def check_layout(case: int) -> dict:
    shape, mesh_shape, placements = CASES[case]
    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    ref = distribute_tensor(full, mesh, placements)  # DTensor's own layout (rank 0's data, broadcast)
    local = ref.to_local()
    out = {"own_block": layout.local_block(ref), "local_shape": tuple(local.shape),
           "blocks": [layout.local_block(ref, layout.rank_coordinate(mesh, r)) for r in range(dist.get_world_size())]}
    assert torch.equal(full[layout.block_slices(*layout.local_block(ref))], local)
    assert layout.block_of(ref) == layout.local_block(ref)
    assert torch.equal(layout.shard_of(full, ref), local)
    assert torch.equal(layout.distribute_like(full, ref).to_local(), local)
    assert torch.equal(layout.local_part(ref), local)
    target = distribute_tensor(torch.zeros(shape, dtype=torch.float64), mesh, placements)
    layout.copy_shard(target, full)
    assert torch.equal(target.full_tensor(), full.double())
    if len(mesh_shape) == 1 and isinstance(placements[0], Shard):
        dim = placements[0].dim
        start, end = layout.shard_range(shape[dim], mesh.size(), mesh.get_local_rank())
        assert (start, end - start) == (out["own_block"][1][dim], local.shape[dim])
        pieces = [None] * mesh.size()
        dist.all_gather_object(pieces, local)
        assert torch.equal(layout.assemble(pieces, dim, shape), ref.full_tensor())
    return out


@pytest.mark.parametrize("case", range(len(CASES)))
def test_blocks_match_dtensor(case):
    results = harness.run(4, check_layout, case)
    for rank, r in enumerate(results):
        assert r["own_block"][0] == r["local_shape"], r
        for other, theirs in enumerate(results):  # every rank computes every rank's block alike
            assert theirs["blocks"][rank] == r["own_block"], (rank, other)


def test_shard_range_covers_uneven_sizes_in_order():
    for size, parts in [(50257, 4), (6, 4), (0, 3), (8, 2), (1, 4)]:
        ranges = [layout.shard_range(size, parts, i) for i in range(parts)]
        assert [e - s for s, e in ranges] == [c.numel() for c in torch.arange(size).chunk(parts)] + \
            [0] * (parts - len(torch.arange(size).chunk(parts)))
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(parts - 1))
    with pytest.raises(ValueError, match="shard 4 of 4"):
        layout.shard_range(10, 4, 4)


def test_assemble_refuses_pieces_of_another_shape():
    with pytest.raises(ValueError, match=r"shards of a \[5\] tensor reassemble to \[4\]"):
        layout.assemble([torch.zeros(2), torch.zeros(2)], 0, [5])


def _gpt2(cls):
    return cls(GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=11, n_positions=4))


def test_tie_groups_are_the_aliases_torch_drops():
    model = _gpt2(GPT2LMHeadModel)
    sd = model.state_dict(keep_vars=True)
    groups = layout.tie_groups(sd.items())
    assert [g for g in groups if len(g) > 1] == [["transformer.wte.weight", "lm_head.weight"]]
    assert sorted(g[0] for g in groups) == sorted(set(model.state_dict(keep_vars=True)) - {"lm_head.weight"})
    tied = layout.tied_parameters(model)
    assert [[(p, n) for p, _, n in g] for g in tied] == [[("transformer.wte", "weight"), ("lm_head", "weight")]]
    assert {k for k, _ in model.named_parameters()} | {"lm_head.weight"} == \
        {k for k, _ in model.named_parameters(remove_duplicate=False)}


def test_base_prefix_only_for_a_head_model():
    assert layout.base_prefix(_gpt2(GPT2LMHeadModel)) == "transformer"
    assert layout.base_prefix(_gpt2(GPT2Model)) == ""
    assert layout.base_prefix(nn.Linear(2, 2)) == ""


def test_local_grad_of_a_plain_parameter():
    p = nn.Parameter(torch.ones(3))
    assert layout.local_grad(p) is None
    p.grad = torch.full((3,), 2.0)
    assert layout.local_grad(p) is p.grad
