"""SageMaker's legacy ``smp.save`` / ``smp.load`` (modelparallel/checkpoint/sagemaker/legacy.py).

A failure means a per-rank file ``{f}_{pp_rank}_{tp_rank}`` lost a tensor's global shape or
placement, so loading at another TP degree reassembles it wrongly, or the same-layout fast path
changed a value. Values are compared with ``torch.equal`` against those gathered before saving,
model and optimizer state alike (``DistributedOptimizer.local_state_dict``).
"""

import torch

import harness
import modelparallel as smp
from test_checkpoint import build, gathered_state, train


def save_partial(f: str, tp: int):
    model, optimizer = build(tp, seed=0)
    train(model, optimizer, range(2))
    if smp.rdp_rank() == 0:
        smp.save({"model": model.local_state_dict(), "optimizer": optimizer.local_state_dict(), "step": 2}, f)
    smp.save(model.state_dict(), f + ".full", partial=False)
    smp.barrier()
    return gathered_state(model, optimizer)


def load_partial(f: str, tp: int, expected: dict):
    model, optimizer = build(tp, seed=9)
    obj = smp.load(f)
    same_layout = tp == 2
    model.load_state_dict(obj["model"], same_partition_load=same_layout)
    optimizer.load_state_dict(obj["optimizer"])
    got = gathered_state(model, optimizer)
    bad = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not bad, f"differ after smp.load at tp={tp}: {bad[:5]}"
    refused = None
    if not same_layout:
        try:
            model.load_state_dict(obj["model"], same_partition_load=True)
        except ValueError as e:
            refused = str(e)
    model2, _ = build(tp, seed=11)
    model2.load_state_dict(smp.load(f + ".full", partial=False))
    assert torch.equal(model2.state_dict()["transformer.wte.weight"], expected["model/transformer.wte.weight"])
    return obj["step"], refused


def test_legacy_partial_files_load_at_the_same_and_other_degrees(tmp_path):
    f = str(tmp_path / "ckpt")
    expected = harness.run(2, save_partial, f, 2)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.full", "ckpt_0_0", "ckpt_0_1"]
    assert harness.run(2, load_partial, f, 2, expected)[0] == (2, None)
    step, refused = harness.run(4, load_partial, f, 4, expected)[0]
    assert step == 2 and "same_partition_load expects this rank's shard" in refused
    assert harness.run(1, load_partial, f, 1, expected)[0][0] == 2  # at TP=1 shards are whole tensors
