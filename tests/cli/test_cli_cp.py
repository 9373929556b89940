"""``modelparallel train --cp``: context parallelism from the command line.

A run at --cp 2 (2 ranks, each holding half of every sequence) must report, step by step, the
losses of the --cp 1 run on one rank within rounding, and its checkpoint must resume at --cp 1.
Launch shapes and sequence lengths that --cp cannot take are refused before launch, exit status 2.
A failure points at modelparallel/cli/train.py (checks), train_job.py (the split of each batch,
the mean of the ranks' loss shares) or the library's context parallelism itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelparallel.cli import main
from reference import training_rtol

RUN = ["--model", "gpt2-micro", "--tp", "1", "--seq-len", "32", "--batch-size", "2", "--max-files", "5",
       "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0"]


def _train(out: Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", *RUN, "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "metrics.json").read_text())


def test_cp2_trains_like_one_rank_and_resumes_at_cp1(tmp_path):
    one = _train(tmp_path / "cp1", "--nproc", "1", "--cp", "1", "--steps", "4")
    two = _train(tmp_path / "cp2", "--nproc", "2", "--cp", "2", "--steps", "4", "--save-every", "2")
    assert (two["world_size"], two["tp"], two["cp"], two["dp"]) == (2, 1, 2, 1)
    for step, (got, want) in enumerate(zip(two["loss"], one["loss"], strict=True)):
        assert abs(got - want) / want < training_rtol(step), (step, got, want)
    assert abs(two["final_val_loss"] - one["final_val_loss"]) / one["final_val_loss"] < training_rtol(4)
    resumed = _train(tmp_path / "cp2", "--nproc", "1", "--cp", "1", "--steps", "6", "--resume")
    assert resumed["first_step"] == 4 and len(resumed["loss"]) == 6


@pytest.mark.parametrize("extra, problem", [
    (["--cp", "3", "--nproc", "4"], "--tp 1 x --cp 3 = 3 does not divide --nproc 4"),
    (["--cp", "2", "--nproc", "2", "--seq-len", "30"], "--seq-len 30 is not divisible by 2 x --cp = 4"),
    (["--cp", "0"], "--cp must be >= 1, got 0"),
])
def test_cp_arguments_checked_before_launch(extra, problem, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", *RUN, "--out", str(tmp_path), *extra])
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err
