"""A resume is all or nothing for every failure, including one found in the middle of reading.

A data file is truncated, deleted or has a byte flipped at the moment its part is read (after
any earlier check of the checkpoint passed): the resume must fail on every rank naming the file,
and the model, optimizer state, hyperparameters and loss scaler must be exactly what they were
(compared tensor by tensor). A resume armed before the model exists and refused when the
optimizer arrives must leave the model as it was built. A failure means a load wrote into live
tensors before everything was read and verified: look at checkpoint/safety/files.py (verified reads),
parts.py / partial.py (staging and the swap) and pending.py (the order of the steps).
"""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import GPT2LMHeadModel

import harness
import modelparallel as smp
from ckpt_helpers import build, cfg, changed, error_of, snapshot
from modelparallel import runtime


def _corrupt(path: Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    elif how == "delete":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))


def _keys(state, prefix: str = "") -> list[str]:
    if not isinstance(state, dict):
        return [prefix]
    return [k for name, v in state.items() for k in _keys(v, f"{prefix}{name}.")]


def _reads_tensors(state) -> bool:
    """Whether a DCP load reads parameters or optimizer slots (not only hyperparameters)."""
    return any(not k.startswith(("optimizer.param_groups", "loss_scaler")) for k in _keys(state))


def corrupt_while_reading(path: str, part: str, how: str) -> dict:
    """Save, then resume into another trained model; the first read of ``part``'s tensors finds
    its rank-1 data file damaged."""
    build()
    smp.save_checkpoint(path, "a")
    model, optimizer = build(seed=1)
    before = snapshot(model, optimizer)
    victim = Path(path) / "a_partial" / part / "__1_0.distcp"
    original, done = dcp.load, []

    def load(*args, **kwargs):
        if not done and str(kwargs["storage_reader"].path).endswith(f"/{part}") and _reads_tensors(args[0]):
            done.append(True)
            if smp.rank() == 0:
                _corrupt(victim, how)
            smp.barrier()
        return original(*args, **kwargs)

    dcp.load = load
    try:
        msg = error_of(smp.resume_from_checkpoint, path)
    finally:
        dcp.load = original
    return {"msg": msg, "changed": changed(before, snapshot(model, optimizer)), "armed": runtime.current().pending_resume}


@pytest.mark.parametrize("part", ["model", "optimizer"])
@pytest.mark.parametrize("how", ["truncate", "delete", "flip"])
def test_damage_found_while_reading_changes_nothing(tmp_path, part, how):
    results = harness.run(2, corrupt_while_reading, str(tmp_path), part, how)
    assert results[0]["msg"] == results[1]["msg"], "every rank raises the same error"
    msg = results[0]["msg"]
    assert f"a_partial/{part}/__1_0.distcp" in msg.splitlines()[0], msg
    for r in results:
        assert r["changed"] == [], f"changed by a failed resume: {r['changed'][:5]}"
        assert r["armed"] is None


def deferred_then_refused(path: str) -> dict:
    """Resume before the model exists; the model loads when created; the optimizer's part does
    not fit (another number of parameter groups): the model must be back as built."""
    model, _ = build()
    smp.save_checkpoint(path, "a")
    smp.init({"tensor_parallel_degree": 2, "random_seed": 5})
    built = snapshot(smp.DistributedModel(GPT2LMHeadModel(cfg())))  # the model as seed 5 builds it
    smp.init({"tensor_parallel_degree": 2, "random_seed": 5})
    smp.resume_from_checkpoint(path)
    model = smp.DistributedModel(GPT2LMHeadModel(cfg()))
    loaded = changed(built, snapshot(model))
    params = list(model.parameters())
    msg = error_of(smp.DistributedOptimizer, torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}]))
    return {"loaded": loaded, "msg": msg, "changed": changed(built, snapshot(model)),
            "armed": runtime.current().pending_resume}


def test_resume_armed_before_the_model_restores_it_when_the_optimizer_is_refused(tmp_path):
    for r in harness.run(2, deferred_then_refused, str(tmp_path)):
        assert r["loaded"], "the deferred resume loaded the model when it was created"
        assert "param_groups: checkpoint has 1, this optimizer 2" in r["msg"], r["msg"]
        assert r["changed"] == [], f"the model kept the refused checkpoint's values: {r['changed'][:5]}"
        assert r["armed"] is None
