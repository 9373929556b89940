"""``replicate_plain_parameters``: the parameters left whole beside sharded ones become ``Replicate()``
DTensors, and their modules still compute exactly what the plain module computes.

A failure here means a tie split into two tensors, a module computing on something other than its
weight's local tensor (output or gradient not bitwise equal to the plain module's), or a shadowing
local tensor left behind after a forward (modelparallel/tp/dtensor_params.py).
"""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import harness
from modelparallel.tp.dtensor_params import replicate_plain_parameters


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # a tie between two modules
        self.sharded = nn.Linear(6, 6)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def _net(mesh, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        net = Net()
    plain = copy.deepcopy(net)
    net.sharded.weight = nn.Parameter(distribute_tensor(net.sharded.weight.detach(), mesh, [Shard(0)]))
    return net, plain


def whole_parameters_become_replicated():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    net, plain = _net(mesh)
    names = replicate_plain_parameters(net, mesh)
    assert names == ["emb.weight", "norm.weight", "norm.bias", "sharded.bias"], names
    assert net.head.weight is net.emb.weight, "the tie is one tensor"
    for name, p in net.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh == mesh, name
    assert net.norm.weight.placements == (Replicate(),)
    ids = torch.tensor([[1, 2, 3, 9]])
    out, want = net(ids), plain(ids)
    assert type(out) is torch.Tensor and torch.equal(out, want), "the plain module's arithmetic"
    out.sum().backward()
    want.sum().backward()
    for name, p in net.named_parameters():
        if name.startswith("sharded"):
            continue
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Replicate(),), name
        assert torch.equal(p.grad.to_local(), dict(plain.named_parameters())[name].grad), name
    assert "weight" not in net.norm.__dict__, "no local tensor left behind"
    with pytest.raises(RuntimeError):
        net.norm(torch.ones(2, 5))  # the wrong width: the forward raises
    assert "weight" not in net.norm.__dict__ and isinstance(net.norm.weight, DTensor)


def unsharded_model_stays_plain():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    net = Net()
    assert replicate_plain_parameters(net, mesh) == []
    assert not any(isinstance(p, DTensor) for p in net.parameters())


def meta_parameters():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    net, _ = _net(mesh, "meta")
    replicate_plain_parameters(net, mesh)
    assert net.norm.weight.to_local().is_meta and net.norm.weight.shape == (6,)


@pytest.mark.parametrize("check", [whole_parameters_become_replicated, unsharded_model_stays_plain, meta_parameters])
def test_replicate_plain_parameters(check):
    harness.run(2, check)
