"""A v1 partial checkpoint whose manifest was deleted (by a cleanup script, or by someone with
write access who wants unverified parts loaded): without the manifest no file's checksum can
be checked, so the resume must be refused on every rank, naming the directory and the missing
``checkpoint_manifest.json``, with nothing changed. 2 ranks, TP=2.

A failure points at ``commit.read_manifest`` as ``api.locate`` / ``api._prepare`` call it.
"""

from pathlib import Path

import harness
import modelparallel as smp
from ckpt_helpers import build, changed, error_of, on_rank0, snapshot


def manifest_removed(path: str) -> dict:
    build()
    smp.save_checkpoint(path, "a")
    on_rank0(lambda: (Path(path) / "a_partial" / "checkpoint_manifest.json").unlink())
    model, optimizer = build(seed=1)
    before = snapshot(model, optimizer)
    return {"newest": error_of(smp.resume_from_checkpoint, path),
            "tag": error_of(smp.resume_from_checkpoint, path, tag="a"),
            "changed": changed(before, snapshot(model, optimizer))}


def test_a_partial_checkpoint_without_its_manifest_is_refused(tmp_path):
    for r in harness.run(2, manifest_removed, str(tmp_path)):
        for msg in (r["newest"], r["tag"]):
            assert f"{tmp_path}/a_partial is not a complete modelparallel checkpoint: no checkpoint_manifest.json" \
                in msg, msg
        assert r["changed"] == [], r["changed"]
