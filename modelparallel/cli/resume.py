"""Which checkpoint ``train --resume`` / ``--resume-from`` continues from, decided before launch.

A resume that silently starts from step 0 (a typo in ``--out``) throws a run away, and a damaged
checkpoint found by the ranks is found N times; so the launcher resolves the request once, reads
every file of the chosen checkpoint against its checksums, and refuses with a message that lists
what exists. The ranks then resume exactly the checkpoint the launcher chose.

``--resume``: the newest checkpoint, which must exist. ``--resume auto``: the newest if there is
one, else a fresh start. ``--resume-from TAG``: that checkpoint (e.g. an older one next to a
damaged newest). The newest is the one ``newest`` names; without that file (lost, deleted), or
with it empty (a write of it that never finished: a crash, a full disk), the intact checkpoint
committed last (its manifest's commit time), said in a note naming the file and which of the two
it is: an empty ``newest`` names nothing, so it is taken as no ``newest``. A ``newest`` that
cannot be read or names no partial checkpoint there, or a missing one beside checkpoints ``train``
did not save, is refused (listing what exists), never taken for a fresh start.

A run writes only over its own history: with ``--save-every``, a directory holding checkpoints the
run did not grow from (any, for a fresh start; later steps or other tags, for a resume) is
refused before launch, since the run would overwrite their tags and retention (``--keep``) would
delete them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Checkpoints are read here through the checkpoint package's torch-free modules (``safety`` but
# its ``errors``, ``format``): the launcher runs this before every launch with a resume, and the
# package's ``api`` and ``safety.errors`` import torch.distributed and DCP (seconds).

PARTIAL = "_partial"
TAG_ENV = "MODELPARALLEL_CLI_RESUME_TAG"
"""The checkpoint the launcher chose for the ranks (empty: a fresh start): they resume exactly it."""
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
    if not ckpt_dir.is_dir():  # first: nothing to read, nothing of the checkpoint package to import
        return []
    from ..checkpoint.safety import commit

    return [name[:-len(PARTIAL)] for _, name in reversed(commit.saved_checkpoints(ckpt_dir))]


def damage(ckpt_dir: Path, tag: str) -> list[str]:
    """Every file of checkpoint ``tag`` that is missing or fails its checksum (empty if intact)."""
    from ..checkpoint.safety import commit

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
        return f"{how}: nothing to resume: {ckpt_dir} " + \
            ("is not a directory" if ckpt_dir.exists() else "does not exist (is --out right?)")
    entries = sorted(p.name for p in ckpt_dir.iterdir())
    return (f"{how}: nothing to resume: {ckpt_dir} holds no complete checkpoint "
            f"(it holds: {', '.join(entries) or 'nothing'}); use --resume auto to start fresh when "
            "there is none")


def newest_is_empty(ckpt_dir: Path) -> bool:
    """Whether ``ckpt_dir/newest`` exists although ``read_newest`` found no name in it (empty or
    blank). Only asked after ``read_newest`` returned None, which it does for a missing file too."""
    from ..checkpoint.safety import commit

    return os.path.lexists(ckpt_dir / commit.NEWEST)


def _newest(ckpt_dir: Path, verify: bool) -> tuple[str | None, str, list[str]]:
    """(tag, note, problems) of ``--resume``: the checkpoint ``newest`` names; without that file
    or with it empty, the intact ``train`` checkpoint committed last, with a note saying so."""
    if not ckpt_dir.is_dir():
        return None, "", []
    from ..checkpoint.safety import commit
    from ..checkpoint.safety.failure import CheckpointError

    tags = saved_tags(ckpt_dir)
    try:
        newest = commit.read_newest(ckpt_dir)
    except (OSError, ValueError, CheckpointError) as exc:  # a directory, FIFO, link, huge or binary file
        return None, "", [f"--resume: {ckpt_dir}/newest cannot be read ({exc}); saved: {', '.join(tags) or 'none'} "
                          "(pick one with --resume-from TAG, or remove it)"]
    if newest is not None:
        tag = newest.removesuffix(PARTIAL)
        if newest == tag or tag not in tags:  # names no partial checkpoint here: never a silent fresh start
            return None, "", [f"--resume: {ckpt_dir}/newest names {newest!r}, which is not a complete partial checkpoint; "
                              f"saved: {', '.join(tags) or 'none'} (pick one with --resume-from TAG)"]
        return tag, "", []
    steps = [t for t in tags if tag_step(t) is not None]
    empty = newest_is_empty(ckpt_dir)
    absent = "is empty (it names no checkpoint)" if empty else "is missing"
    damaged = []
    for tag in steps:
        if not verify or not damage(ckpt_dir, tag):
            skipped = f" (skipping damaged {', '.join(damaged)})" if damaged else ""
            return tag, (f"{ckpt_dir}/newest {absent}: resuming {tag}, the intact checkpoint committed "
                         f"last{skipped}"), []
        damaged.append(tag)
    if damaged:
        return None, "", [f"--resume: {ckpt_dir}/newest {absent} and every checkpoint is damaged "
                          f"({', '.join(damaged)})"]
    if not tags:  # nothing to resume: a fresh start (--resume auto), said when an empty newest was there
        return None, f"{ckpt_dir}/newest {absent} and no checkpoint is there" if empty else "", []
    return None, "", [f"--resume: {ckpt_dir}/newest {absent} and none of its checkpoints is one train saved "
                      f"(stepN); saved: {', '.join(tags)} (pick one with --resume-from TAG)"]


def choose(out: Path, resume: str | None, resume_from: str | None, steps: int,
           verify: bool, notes: list[str] | None = None) -> tuple[str | None, list[str]]:
    """(tag to resume or None for a fresh start, problems). ``verify`` reads the chosen
    checkpoint's files against their checksums (done once, by the launcher). A note for the
    user (the checkpoint chosen without ``newest``) is appended to ``notes``."""
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
        tag, note, problems = _newest(ckpt_dir, verify)
        if problems:
            return None, problems
        if note and notes is not None:
            notes.append(note)
        if tag is None:
            return None, [] if resume == "auto" else [_nothing_there(ckpt_dir, "--resume")]
        how = "--resume"
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


def launcher_choice() -> tuple[bool, str | None]:
    """(whether our launcher chose, its tag or None for a fresh start), as a rank sees it."""
    if TAG_ENV not in os.environ:
        return False, None
    return True, os.environ[TAG_ENV] or None


def foreign_problems(out: Path, tag: str | None, save_every: int) -> list[str]:
    """Checkpoints a run that saves would overwrite or let retention delete without having grown
    from them: with a fresh start, every checkpoint there; with a resume from ``tag``, those of
    later steps (an abandoned continuation) and those of other tags."""
    if not save_every:
        return []
    ckpt_dir = checkpoint_dir(out)
    start = 0 if tag is None else tag_step(tag)
    if start is None:  # resumed from a tag train does not write: its own saves are all new
        start = -1
    others = [t for t in saved_tags(ckpt_dir) if t != tag and ((s := tag_step(t)) is None or s > start)]
    if not others:
        return []
    what = "a fresh start" if tag is None else f"a run resumed from {tag}"
    fix = ("continue that run with --resume, or choose another --out" if tag is None else
           "move them elsewhere (or delete them) if that continuation is to be replaced, or choose another --out")
    return [f"--save-every {save_every}: {ckpt_dir} holds checkpoints {', '.join(others)} that {what} did not "
            f"save; its saves would overwrite them and --keep would delete them: {fix}"]


def config_problems(out: Path, tag: str, config) -> list[str]:
    """How checkpoint ``tag`` was saved from another model than ``config`` (empty if the same),
    read from its manifest: the ranks' load would refuse it after launch."""
    from ..checkpoint.safety import commit
    from ..checkpoint.format import model_config

    try:
        manifest = commit.read_manifest(checkpoint_dir(out) / (tag + PARTIAL))
    except (OSError, ValueError):
        return []  # reported by the damage check
    return model_config.differences(manifest.get("config"), config)


def matching_tags(out: Path, config, skip: str | None = None) -> list[str]:
    """Intact tags (newest first) saved from the same model as ``config``: what a rerun can resume."""
    ckpt_dir = checkpoint_dir(out)
    return [t for t in intact_tags(ckpt_dir, skip=skip) if not config_problems(out, t, config)]


def saved_step(content, tag: str, where: Path) -> int:
    """The step that checkpoint ``tag``'s user content records (a rank reads it after the load).

    Raises:
        ValueError: naming ``where``, unless it is a step >= 0 and, for a ``train`` tag
            (``step400``), that tag's step: a larger one would skip data the weights never saw.
    """
    step = content.get("step") if isinstance(content, dict) else None
    tagged = tag_step(tag)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or tagged not in (None, step):
        raise ValueError(f"{where}: its user content says step {step!r}, its tag step {tagged}: not a checkpoint "
                         "train saved (forged or edited)")
    return step
