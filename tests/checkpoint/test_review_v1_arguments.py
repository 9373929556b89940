"""Ranks that pass different arguments to a v1 checkpoint call, an ordinary mistake (a tag
built from the rank, a step counter that drifted on one rank): ``save_checkpoint`` wrote rank
0's tag and returned success on the rank that asked for another (its checkpoint does not
exist), and ``resume_from_checkpoint`` read each rank's shard from a different checkpoint
(a silent mix of two steps). Each must raise ``ValueError`` on every rank, naming the argument
and every rank's value, before anything is written or loaded.

A failure points at ``safety/errors.py``'s ``same_on_every_rank`` (called by api.py). 2 ranks, TP=2.
"""

from pathlib import Path

import harness
import modelparallel as smp
from ckpt_helpers import build, changed, error_of, snapshot


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".mp-lock" not in p.name)


def different_tags(path: str, partial: bool) -> dict:
    root = Path(path)
    build()
    rank = smp.rank()
    out = {"save": error_of(smp.save_checkpoint, root / "d", f"t{rank}", partial=partial),
           "path": error_of(smp.save_checkpoint, root / f"p{rank}", "t", partial=partial)}
    out["disk"] = _listing(root)
    smp.barrier()
    (root / "real").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (root / "link").symlink_to(root / "real")
    smp.barrier()
    smp.save_checkpoint(root / ("real" if rank == 0 else "link"), "s", partial=partial)  # one directory, named two ways
    smp.save_checkpoint(root / "d", "t0", partial=partial)
    smp.save_checkpoint(root / "d", "t1", partial=partial)
    model, optimizer = build(seed=1)
    before = snapshot(model, optimizer)
    out["resume"] = error_of(smp.resume_from_checkpoint, root / "d", tag=f"t{rank}", partial=partial)
    out["changed"] = changed(before, snapshot(model, optimizer))
    return out


def test_different_tags_or_paths_are_refused_on_every_rank(tmp_path):
    for partial in (True, False):
        for r in harness.run(2, different_tags, str(tmp_path / str(partial)), partial):
            assert r["save"].startswith("ValueError: save_checkpoint: every rank must pass the same tag; "
                                        "got tag: rank 0 't0', rank 1 't1'"), r["save"]
            assert "every rank must pass the same path" in r["path"] and "p0" in r["path"] and "p1" in r["path"], \
                r["path"]
            assert r["disk"] == [], f"a refused save wrote {r['disk']}"
            assert "every rank must pass the same tag; got tag: rank 0 't0', rank 1 't1'" in r["resume"], r["resume"]
            assert r["changed"] == [], r["changed"]


def same_text(path: str) -> dict:
    """One path text that resolves differently on each rank (as one shared directory mounted at
    different points on different machines does): accepted; another text and another
    directory: refused."""
    import os

    from modelparallel.checkpoint.safety.errors import same_on_every_rank

    here = Path(path) / f"machine{smp.rank()}"
    here.mkdir(parents=True, exist_ok=True)
    build()
    back = os.getcwd()
    os.chdir(here)  # the ranks are reused by later tests: the directory is restored below
    try:
        same_on_every_rank("save_checkpoint", path="ckpt", tag="t", partial=True)
        return {"other text": error_of(same_on_every_rank, "save_checkpoint", path=f"ckpt{smp.rank()}", tag="t",
                                       partial=True)}
    finally:
        os.chdir(back)


def test_one_path_text_is_accepted_wherever_it_resolves(tmp_path):
    for r in harness.run(2, same_text, str(tmp_path)):
        assert "every rank must pass the same path" in r["other text"], r["other text"]
