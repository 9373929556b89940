"""``init_optim_state``: optimizer state to load a checkpoint into, without changing training.

A failure of the first test means calling it changed what happens next (the parameters, their
gradients, AdamW's step count or moments: PyTorch's own ``_init_optim_state`` steps the live
optimizer); of the second, that a load into the placeholders was thrown away; of the third, that
parameters FSDP1 holds no shard of got state training never gives them.
"""

import copy

import torch
from torch import nn

from modelparallel.distributed.checkpoint.state_dict_utils import init_optim_state


def model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)


def steps(model, opt, n):
    out = []
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_placeholders_change_nothing_when_not_loaded():
    model, opt = model_and_opt()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1, weight_decay=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    init_optim_state(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "parameters moved"
    assert all(p.grad is None for p in model.parameters()), "gradients left behind"
    sd = opt.state_dict()["state"]
    assert len(sd) == 4 and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in sd.values())
    assert steps(model, opt, 3) == steps(twin, twin_opt, 3)
    assert all(s["step"].item() == 3 for s in opt.state.values())


def test_loaded_placeholders_are_kept():
    model, opt = model_and_opt()
    trained, trained_opt = model_and_opt()
    steps(trained, trained_opt, 2)
    init_optim_state(opt)
    mine = opt.state_dict()
    with torch.no_grad():  # what a DCP load does: write into the tensors in place
        for k, state in trained_opt.state_dict()["state"].items():
            for name, value in state.items():
                mine["state"][k][name].copy_(value)
        for a, b in zip(model.parameters(), trained.parameters()):
            a.copy_(b)
    assert steps(model, opt, 2) == steps(trained, trained_opt, 2)


def test_skip_empty_param():
    params = [nn.Parameter(torch.zeros(0)), nn.Parameter(torch.ones(3))]
    opt = torch.optim.AdamW(params)
    init_optim_state(opt, skip_empty_param=True)
    assert params[0] not in opt.state and params[1] in opt.state
