"""Forged or damaged checkpoint files found by review: each is refused before anything live
changes, on every rank alike, with a message naming the file (and the key) at fault.

A failure means a check runs too late (after the model or optimizer changed: see
modelparallel/checkpoint/optim_part.py ``plan_load``), or an error lost the file's name. 2 ranks,
TP=2 where collectives matter.
"""

import io
import tempfile
from pathlib import Path

import torch

import harness
import modelparallel as smp
from ckpt_helpers import changed, error_of, on_rank0, refresh_manifest, rewrite_metadata, snapshot

MASTER = "fp16_states.transformer.h.0.mlp.c_fc.weight.master"


def _masters(optimizer) -> dict:
    return {f"master{i}": (m.to_local() if hasattr(m, "to_local") else m).detach().clone()
            for i, (p, m) in enumerate(optimizer.master_weights.params_and_masters()) if m is not p}


def forge_scalar(part: Path, key: str) -> None:
    """What a forger with write access does: store ``key`` as a consistent 0-dim tensor (its
    bytes appended to a data file, metadata and storage index pointing at them)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    data = io.BytesIO()
    torch.save(torch.tensor(1.0), data)
    target = part / "__0_0.distcp"
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(data.getvalue())

    def forge(md):
        entry = md.state_dict_metadata[key]
        entry.size = torch.Size([])
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
        for index in [i for i in md.storage_data if i.fqn == key]:
            del md.storage_data[index]
        md.storage_data[MetadataIndex(key, torch.Size([]))] = _StorageInfo(target.name, offset, len(data.getvalue()))

    rewrite_metadata(part / ".metadata", forge)


def forged_master(path: str, journal_dir: str) -> dict:
    """An fp16 job's checkpoint whose fp32 master has shape () in the optimizer's metadata (the
    manifest recomputed, as a forger would): each staging mode refuses it, changing nothing."""
    from test_checkpoint_side_effects import build, step

    model, optimizer = build(0, True)
    step(model, optimizer, 0)
    smp.save_checkpoint(path, "a")
    directory = Path(path) / "a_partial"

    on_rank0(lambda: (forge_scalar(directory / "optimizer", MASTER), refresh_manifest(directory)))
    out = {}
    for mode in ("memory", "journal"):
        model, optimizer = build(1, True)
        step(model, optimizer, 1)
        before = {**snapshot(model, optimizer), **_masters(optimizer)}
        tempfile.tempdir = journal_dir
        try:
            out[mode] = error_of(smp.resume_from_checkpoint, path, "a", staging=mode, staging_bucket=1 << 12)
        finally:
            tempfile.tempdir = None
        out[f"{mode} changed"] = changed(before, {**snapshot(model, optimizer), **_masters(optimizer)})
    return out


def test_a_forged_master_shape_is_refused_before_anything_changes(tmp_path):
    results = harness.run(2, forged_master, str(tmp_path / "ck"), str(tmp_path))
    for mode in ("memory", "journal"):
        assert results[0][mode] == results[1][mode], results
        msg = results[0][mode]
        assert MASTER in msg and "a_partial/optimizer/.metadata" in msg and "()" in msg, msg
        for r in results:
            assert r[f"{mode} changed"] == [], (mode, r[f"{mode} changed"][:5])
