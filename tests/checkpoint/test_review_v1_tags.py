"""A v1 tag with surrounding whitespace (``f" {step}"``): ``newest`` is read stripped, so a
full checkpoint tagged ``" a"`` was recorded as ``newest`` = ``"a"``, and a resume with
``tag=None`` loaded another checkpoint (``a``) silently. Such a tag must be refused on every
rank before anything is written; ``newest`` keeps naming the last good checkpoint. 2 ranks, TP=2.

A failure points at ``api._check_save_args``.
"""

from pathlib import Path

import harness
import modelparallel as smp
from ckpt_helpers import build, error_of


def spaced_tag(path: str) -> dict:
    build()
    smp.save_checkpoint(path, "a", partial=False)
    out = {tag: error_of(smp.save_checkpoint, path, tag, partial=False) for tag in (" a", "b\n")}
    out["newest"] = (Path(path) / "newest").read_text()
    out["dirs"] = sorted(p.name for p in Path(path).iterdir() if not p.name.startswith("."))
    return out


def test_a_tag_with_surrounding_whitespace_is_refused(tmp_path):
    for r in harness.run(2, spaced_tag, str(tmp_path)):
        for tag in (" a", "b\n"):
            assert r[tag].startswith("ValueError: save_checkpoint: tag must be a non-empty name without '/' or "
                                     f"surrounding whitespace") and repr(tag) in r[tag], r[tag]
        assert r["newest"] == "a\n" and r["dirs"] == ["a", "newest", "user_content_a"], r
