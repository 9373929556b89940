"""An empty ``newest`` (it exists, names nothing: a write of it that never finished) is said to be
empty, naming the file, and treated as no ``newest``: ``train --resume`` / ``--resume auto`` take
the intact checkpoint committed last with a note, ``inspect`` reports it and exits 1.

The checkpoint directories are made by hand: a manifest (sizes, CRC32s, commit times) over one
small file per checkpoint, which is all that choosing and inspecting read. A failure points at
``_newest`` / ``newest_is_empty`` in modelparallel/cli/resume.py or ``scan`` in
modelparallel/cli/inspect.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelparallel.checkpoint.safety import commit
from modelparallel.cli import launch, main
from modelparallel.cli.resume import TAG_ENV, choose

RUN = ["--model", "gpt2-micro", "--tp", "2", "--nproc", "2", "--seq-len", "32", "--batch-size", "2",
       "--max-files", "5", "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0"]
EMPTY = {"empty": b"", "blank": b"\n"}


def _checkpoints(out: Path, *tags: str, newest: bytes | None = None) -> Path:
    """``out/checkpoints`` with a partial checkpoint per tag (the last committed last) and, unless
    ``newest`` is None, a ``newest`` file holding those bytes."""
    ckpt = out / "checkpoints"
    for i, tag in enumerate(tags):
        d = ckpt / f"{tag}_partial"
        (d / "model").mkdir(parents=True)
        (d / "model" / "part.bin").write_bytes(bytes(range(7 + i)))
        commit.write_manifest(d, {"format": "modelparallel-partial", "version": 1, "tag": tag, "parts": ["model"],
                                  "saved_at_ns": 1_000 + i,
                                  "files": {"model/part.bin": commit.file_checksum(d / "model" / "part.bin")}})
    if newest is not None:
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / commit.NEWEST).write_bytes(newest)
    return ckpt


@pytest.mark.parametrize("what", EMPTY)
def test_resume_says_newest_is_empty_and_takes_the_intact_checkpoint_committed_last(tmp_path, what):
    ckpt = _checkpoints(tmp_path, "step2", "step4", newest=EMPTY[what])
    for how in ("auto", "newest"):
        notes = []
        assert choose(tmp_path, how, None, 10, verify=True, notes=notes) == ("step4", [])
        assert notes == [f"{ckpt / 'newest'} is empty (it names no checkpoint): resuming step4, the intact "
                         "checkpoint committed last"], notes
    (ckpt / "step4_partial" / "model" / "part.bin").write_bytes(b"flipped")
    notes = []
    assert choose(tmp_path, "auto", None, 10, verify=True, notes=notes) == ("step2", [])
    assert "newest is empty (it names no checkpoint): resuming step2" in notes[0] and "skipping damaged step4" \
        in notes[0], notes


def test_a_missing_newest_is_still_called_missing(tmp_path):
    ckpt = _checkpoints(tmp_path, "step2", "step4")
    notes = []
    assert choose(tmp_path, "auto", None, 10, verify=True, notes=notes) == ("step4", [])
    assert notes == [f"{ckpt / 'newest'} is missing: resuming step4, the intact checkpoint committed last"], notes


def test_an_empty_newest_without_checkpoints(tmp_path):
    """``--resume auto`` starts fresh (nothing to resume), saying so; ``--resume`` is refused."""
    ckpt = _checkpoints(tmp_path, newest=b"")
    notes = []
    assert choose(tmp_path, "auto", None, 10, verify=True, notes=notes) == (None, [])
    assert notes == [f"{ckpt / 'newest'} is empty (it names no checkpoint) and no checkpoint is there"], notes
    tag, problems = choose(tmp_path, "newest", None, 10, verify=True)
    assert tag is None and "nothing to resume" in problems[0] and "it holds: newest" in problems[0], problems


def test_train_resume_prints_the_note_and_hands_the_ranks_that_checkpoint(tmp_path, capsys, monkeypatch):
    """Through ``modelparallel train``: the launcher's check, its note, the tag given to the ranks
    (the launch itself replaced by a recorder)."""
    ckpt = _checkpoints(tmp_path, "step2", "step4", newest=b"")
    launched = []
    monkeypatch.setattr(launch, "torchrun", lambda nodes, argv, env: launched.append(env))
    assert main(["train", *RUN, "--out", str(tmp_path), "--steps", "8", "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert "from checkpoint step4" in err and f"{ckpt / 'newest'} is empty (it names no checkpoint): resuming " \
        "step4" in err, err
    assert [env[TAG_ENV] for env in launched] == ["step4"]


def test_inspect_reports_an_empty_newest(tmp_path, capsys):
    ckpt = _checkpoints(tmp_path, "step2", "step4", newest=b"")
    assert main(["inspect", str(ckpt)]) == 1
    text = capsys.readouterr().out
    assert f"newest: EMPTY: {ckpt / 'newest'} names no checkpoint" in text, text
    assert "step4_partial" in text and "step2_partial" in text and "MISSING" not in text, text
    assert main(["inspect", "--json", str(ckpt)]) == 1
    assert json.loads(capsys.readouterr().out)["newest_empty"] == str(ckpt / "newest")
    (ckpt / "newest").unlink()  # a missing newest is no damage of its own: nothing said, exit 0
    assert main(["inspect", str(ckpt)]) == 0
    assert "newest:" not in capsys.readouterr().out
