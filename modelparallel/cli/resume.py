"""Which checkpoint ``train --resume`` / ``--resume-from`` continues from, decided before launch.

A resume that silently starts from step 0 (a typo in ``--out``) throws a run away, and a damaged
checkpoint found by the ranks is found N times; so the launcher resolves the request once, reads
every file of the chosen checkpoint against its checksums, and refuses with a message that lists
what exists. The ranks then resume exactly the checkpoint the launcher chose.

``--resume``: the newest checkpoint, which must exist. ``--resume auto``: the newest if there is
one, else a fresh start. ``--resume-from TAG``: that checkpoint (e.g. an older one next to a
damaged newest).
"""

from __future__ import annotations

import re
from pathlib import Path

PARTIAL = "_partial"
_STEP_TAG = re.compile(r"^step(\d+)$")


def checkpoint_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def step_tag(step: int) -> str:
    """The tag ``train`` saves step ``step`` under."""
    return f"step{step}"


def tag_step(tag: str) -> int | None:
    """The step a ``train`` tag names, None for other tags."""
    m = _STEP_TAG.match(tag)
    return int(m.group(1)) if m else None


def saved_tags(ckpt_dir: Path) -> list[str]:
    """Tags of the complete partial checkpoints in ``ckpt_dir``, newest first."""
    from ..checkpoint import commit

    if not ckpt_dir.is_dir():
        return []
    return [name[:-len(PARTIAL)] for _, name in reversed(commit.saved_checkpoints(ckpt_dir))]


def damage(ckpt_dir: Path, tag: str) -> list[str]:
    """Every file of checkpoint ``tag`` that is missing or fails its checksum (empty if intact)."""
    from ..checkpoint import commit

    directory = ckpt_dir / (tag + PARTIAL)
    try:
        manifest = commit.read_manifest(directory)
    except (OSError, ValueError) as exc:
        return [f"unreadable manifest: {exc}"]
    return [p for rel, entry in manifest.get("files", {}).items()
            if (p := commit.verify_file(directory, rel, entry))]


def intact_tags(ckpt_dir: Path, skip: str | None = None) -> list[str]:
    """Tags (newest first) whose every file matches its checksum."""
    return [t for t in saved_tags(ckpt_dir) if t != skip and not damage(ckpt_dir, t)]


def _nothing_there(ckpt_dir: Path, how: str) -> str:
    if not ckpt_dir.is_dir():
        return f"{how}: nothing to resume: {ckpt_dir} does not exist (is --out right?)"
    entries = sorted(p.name for p in ckpt_dir.iterdir())
    return (f"{how}: nothing to resume: {ckpt_dir} holds no complete checkpoint "
            f"(it holds: {', '.join(entries) or 'nothing'}); use --resume auto to start fresh when "
            "there is none")


def choose(out: Path, resume: str | None, resume_from: str | None, steps: int,
           verify: bool) -> tuple[str | None, list[str]]:
    """(tag to resume or None for a fresh start, problems). ``verify`` reads the chosen
    checkpoint's files against their checksums (done once, by the launcher)."""
    ckpt_dir = checkpoint_dir(out)
    tags = saved_tags(ckpt_dir)
    if resume_from is not None:
        tag = resume_from.removesuffix(PARTIAL)
        if tag not in tags:
            return None, [f"--resume-from {resume_from}: no such complete checkpoint in {ckpt_dir}; "
                          f"saved: {', '.join(tags) or 'none'}"]
        how = f"--resume-from {resume_from}"
    elif resume is None:
        return None, []
    else:
        from ..checkpoint import commit

        newest = commit.read_newest(ckpt_dir) if ckpt_dir.is_dir() else None
        if newest is None or not newest.endswith(PARTIAL):
            return None, [] if resume == "auto" else [_nothing_there(ckpt_dir, "--resume")]
        tag, how = newest[:-len(PARTIAL)], "--resume"
        if tag not in tags:
            return None, [f"--resume: {ckpt_dir}/newest names {newest}, which is not a complete checkpoint; "
                          f"saved: {', '.join(tags) or 'none'} (pick one with --resume-from TAG)"]
    step = tag_step(tag)
    if step is not None and step >= steps:
        return None, [f"{how}: checkpoint {tag} is at step {step}, and --steps is {steps}: nothing left "
                      "to train (raise --steps to train further)"]
    problems = damage(ckpt_dir, tag) if verify else []
    if problems:
        others = intact_tags(ckpt_dir, skip=tag)
        offer = (f"intact checkpoints: {', '.join(others)} (resume one with --resume-from {others[0]})"
                 if others else "no other intact checkpoint")
        return None, [f"{how}: checkpoint {tag} in {ckpt_dir} is damaged: {'; '.join(problems[:5])}; {offer}"]
    return tag, []
