"""A load refuses what does not match instead of converting it silently: an optimizer of another
class, a model of another configuration with the same shapes, a full checkpoint whose header
states another dtype of the same byte size.

A failure means the load compared shapes only (modelparallel/checkpoint/format/model_config.py,
load/optim_part.py) or trusted a safetensors header's dtype (load/full_load.py) and cast
silently. 2 ranks at TP=2.
"""

import json
import struct
from pathlib import Path

import torch

import harness
import modelparallel as smp
from ckpt_helpers import build, changed, error_of, on_rank0, refresh_manifest, snapshot


def other_kinds(path: str) -> dict:
    """AdamW state into SGD; a checkpoint of 2 heads into a model of 4 heads of the same sizes."""
    build()
    smp.save_checkpoint(path, "a")
    model, optimizer = build(seed=1, optimizer_cls=torch.optim.SGD)
    before = snapshot(model, optimizer)
    msgs = {"sgd": error_of(smp.resume_from_checkpoint, path)}
    sgd_changed = changed(before, snapshot(model, optimizer))
    model, optimizer = build(seed=1, n_head=4)
    msgs["heads"] = error_of(smp.resume_from_checkpoint, path)
    smp.resume_from_checkpoint(path, strict=False)  # non-strict: loads what fits, reports the rest
    return {"msgs": msgs, "changed": sgd_changed, "report": smp.last_load_report()["model"]}


def test_optimizer_class_and_model_config_are_compared(tmp_path):
    for r in harness.run(2, other_kinds, str(tmp_path)):
        assert "optimizer: the checkpoint holds AdamW state, this optimizer is SGD" in r["msgs"]["sgd"], r["msgs"]
        assert "config n_head: checkpoint 2, model 4" in r["msgs"]["heads"], r["msgs"]["heads"]
        assert "config n_head: checkpoint 2, model 4" in r["report"].mismatched_shapes
        assert r["changed"] == []


def dtype_lie(path: str) -> str:
    """A full checkpoint whose header says I32 for an F32 tensor (same byte size)."""
    root = Path(path)
    build()
    smp.save_checkpoint(root, "f", partial=False)

    def lie():
        f = root / "f" / "model.safetensors"
        data = f.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        header["transformer.h.0.mlp.c_fc.weight"]["dtype"] = "I32"
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (n - len(raw))
        f.write_bytes(data[:8] + raw + data[8 + n:])
        refresh_manifest(root / "f")

    on_rank0(lie)
    build(seed=1)
    return error_of(smp.resume_from_checkpoint, root, "f", partial=False)


def test_a_dtype_lie_in_a_full_checkpoint_is_refused(tmp_path):
    for msg in harness.run(2, dtype_lie, str(tmp_path)):
        assert "transformer.h.0.mlp.c_fc.weight" in msg and "I32" in msg and "model.safetensors" in msg, msg
