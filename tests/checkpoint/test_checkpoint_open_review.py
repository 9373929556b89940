"""Review attacks on the v1 read path that the other checkpoint tests do not make.

A failure in the master test means a forged fp32 master whose *data* (not its metadata) lies
passes the plan and changes live state, or fails differently on the two ranks, or without the
file's name: look at modelparallel/checkpoint/load/fastread.py ``_read_chunk``.
"""

import io
from pathlib import Path

import torch

import harness
import modelparallel as smp
from ckpt_helpers import on_rank0, refresh_manifest, rewrite_metadata
from test_checkpoint_forged import MASTER, resume_each_way

def forge_chunks(part: Path, key: str, make) -> None:
    """Leave ``key``'s metadata alone (shape and dtype right, so the plan accepts it) and point
    each of its stored chunks at ``make(saved chunk)`` appended to a data file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def forge(md):
        for index in [i for i in md.storage_data if i.fqn == key]:
            info = md.storage_data[index]
            with open(part / info.relative_path, "rb") as f:
                f.seek(info.offset)
                saved = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
            data = io.BytesIO()
            torch.save(make(saved), data)
            target = part / info.relative_path
            offset = target.stat().st_size
            with open(target, "ab") as f:
                f.write(data.getvalue())
            md.storage_data[index] = _StorageInfo(info.relative_path, offset, len(data.getvalue()))

    rewrite_metadata(part / ".metadata", forge)


FORGERIES = {"scalar": lambda t: torch.tensor(1.0), "fp16": lambda t: t.half(),
             "fewer": lambda t: t.flatten()[1:].clone()}
"""A master stored as a 0-dim tensor, in fp16 (its metadata says fp32), with one element fewer."""


def forged_master_data(path: str, journal_dir: str) -> dict:
    from test_checkpoint_side_effects import build, step

    out = {}
    for how, make in FORGERIES.items():
        model, optimizer = build(0, True)
        step(model, optimizer, 0)
        smp.save_checkpoint(path, how)
        directory = Path(path) / f"{how}_partial"
        on_rank0(lambda: (forge_chunks(directory / "optimizer", MASTER, make), refresh_manifest(directory)))
        out.update({f"{how} {k}": v for k, v in resume_each_way(path, how, journal_dir).items()})
    return out


def test_a_master_whose_stored_data_lies_is_refused_before_anything_changes(tmp_path):
    results = harness.run(2, forged_master_data, str(tmp_path / "ck"), str(tmp_path))
    for how in FORGERIES:
        for mode in ("memory", "journal"):
            msg = results[0][f"{how} {mode}"]
            assert results[1][f"{how} {mode}"] == msg, (how, mode, results)
            assert MASTER in msg and f"{how}_partial/optimizer/__" in msg, (how, mode, msg)
            for r in results:
                assert r[f"{how} {mode} changed"] == [], (how, mode, r[f"{how} {mode} changed"][:5])
