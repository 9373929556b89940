"""``train --resume`` when ``newest`` is gone, and runs that would write over checkpoints they did
not grow from.

A failure means a resume silently starts from step 0 (look at ``_newest`` in
modelparallel/cli/resume.py), or a run overwrites or lets retention delete checkpoints of an
earlier run (``foreign_problems``), or resumes a checkpoint of another model and then suggests
one that fails the same way (``checks.resume_model_problems``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from modelparallel.cli import main
from modelparallel.cli.resume import choose, foreign_problems

RUN = ["--model", "gpt2-micro", "--tp", "2", "--nproc", "2", "--seq-len", "32", "--batch-size", "2",
       "--max-files", "5", "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0"]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "modelparallel.cli", "train", *RUN, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run of 6 steps with checkpoints step2, step4, step6."""
    out = tmp_path_factory.mktemp("saved")
    _train(out, "--steps", "6", "--save-every", "2")
    return out


def _copy(saved: Path, to: Path, newest: bool = False) -> Path:
    shutil.copytree(saved / "checkpoints", to / "checkpoints")
    if not newest:
        (to / "checkpoints" / "newest").unlink()
    return to


def _damage(out: Path, tag: str) -> None:
    shard = sorted((out / "checkpoints" / f"{tag}_partial" / "model").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["train", *RUN, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_without_newest_the_intact_checkpoint_committed_last_is_resumed(saved, tmp_path):
    out = _copy(saved, tmp_path / "lost")
    for how in ("auto", "newest"):
        notes = []
        assert choose(out, how, None, 10, verify=True, notes=notes) == ("step6", [])
        assert "newest is missing: resuming step6" in notes[0]
    _damage(out, "step6")
    notes = []
    assert choose(out, "auto", None, 10, verify=True, notes=notes) == ("step4", [])
    assert "skipping damaged step6" in notes[0]
    _damage(out, "step4")
    _damage(out, "step2")
    tag, problems = choose(out, "auto", None, 10, verify=True)
    assert tag is None and "every checkpoint is damaged (step6, step4, step2)" in problems[0]


def test_a_run_never_saves_over_checkpoints_it_did_not_grow_from(saved, tmp_path, capsys):
    out = _copy(saved, tmp_path / "old", newest=True)
    err = _refused(capsys, "--out", str(out), "--steps", "8", "--save-every", "2")
    assert "holds checkpoints step6, step4, step2 that a fresh start did not save" in err and "--resume" in err
    err = _refused(capsys, "--out", str(out), "--steps", "8", "--save-every", "2", "--resume-from", "step4")
    assert "holds checkpoints step6 that a run resumed from step4 did not save" in err
    assert foreign_problems(out, None, 0) == [] and foreign_problems(out, "step6", 2) == []


def test_a_checkpoint_of_another_model_is_refused_before_launch(saved, tmp_path, capsys):
    out = _copy(saved, tmp_path / "other", newest=True)
    err = _refused(capsys, "--out", str(out), "--steps", "8", "--resume", "--model", "gpt2-tiny")
    assert "checkpoint step6 was saved from another model than --model gpt2-tiny" in err
    assert "config n_embd: checkpoint 64, model 128" in err and "--resume-from" not in err


def test_resume_auto_without_newest_continues_and_keeps_its_checkpoints(saved, tmp_path):
    """The launcher's choice reaches the ranks; the run's retention deletes only its own oldest."""
    out = _copy(saved, tmp_path / "auto")
    proc = _train(out, "--steps", "8", "--save-every", "2", "--keep", "3", "--resume", "auto")
    assert "newest is missing: resuming step6" in proc.stderr and "at step 6" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["first_step"] == 6 and len(metrics["loss"]) == 8
    assert sorted(p.name for p in (out / "checkpoints").glob("step*")) == \
        ["step4_partial", "step6_partial", "step8_partial"]
