"""A model whose layers are replaced through SageMaker-form registration, saved as a partial
checkpoint at TP=2 and resumed at TP=1.

A failure means the replaced modules' tensors (model and optimizer state) do not survive a save
and a load at another degree bit-exactly: the checkpoint code or the replacement's parameter
naming is at fault.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import harness
import modelparallel as smp
from test_tp_register import CFG, MyLayer, Net


def _register():
    smp.tp_register_with_module(MyLayer, smp.nn.DistributedTransformerLayer, init_hook=lambda config: ((), config),
                                forward_hook=lambda hidden_states, attention_mask=None: (((hidden_states, None),), {}),
                                return_hook=lambda out: out[0])


def _build(tp: int, seed: int):
    smp.init({"tensor_parallel_degree": tp, "random_seed": seed})
    _register()
    torch.manual_seed(seed)
    model = smp.DistributedModel(Net(MyLayer, CFG))
    assert type(model.module.layers[0]).__name__ == "DistributedTransformerLayer"
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    out = {f"model/{k}": full(v) for k, v in model.module.state_dict().items()}
    names = {id(p): n for n, p in model.module.named_parameters()}
    for p, slots in optimizer.optimizer.state.items():
        out.update({f"optim/{names[id(p)]}/{k}": full(v) for k, v in slots.items()})
    return out


def save_at(tp: int, path: str):
    model, optimizer = _build(tp, seed=0)
    loss = model(torch.randint(0, 50, (2, 8))).square().mean()
    model.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    smp.save_checkpoint(path, "step_1", user_content={"step": 1})
    return _state(model, optimizer)


def resume_at(tp: int, path: str, expected: dict, partial: bool):
    model, optimizer = _build(tp, seed=5)
    before = _state(model, optimizer)
    assert any(not torch.equal(before[k], v) for k, v in expected.items() if k.startswith("model/"))
    smp.resume_from_checkpoint(path, "step_1" if partial else "full", partial=partial)
    got = _state(model, optimizer)
    keys = [k for k in expected if partial or k.startswith("model/")]
    for key in keys:
        assert torch.equal(got[key], expected[key]), f"{key}: differs after resuming at tp={tp}"
    return len(keys)


def test_registered_model_partial_checkpoint_tp2_to_tp1(tmp_path):
    expected = harness.run(2, save_at, 2, str(tmp_path))[0]
    assert "model/layers.0.attention.query.weight" in expected
    assert "optim/layers.1.output.dense1.weight/exp_avg" in expected
    assert harness.run(1, resume_at, 1, str(tmp_path), expected, True)[0] == len(expected)
