"""``modelparallel train --pp``: a real two-stage pipeline run end to end, and the argument
checks that refuse a pipeline shape before any rank starts.

A failure in the run means the CLI's step functions (modelparallel/cli/train_job.py: training
and validation through ``@smp.step``) do not run at pipeline degree 2; in the checks, that
modelparallel/cli/train.py lets a bad ``--pp`` through to the ranks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from modelparallel.cli import main
from modelparallel.cli.presets import build_model


def test_train_command_two_stages(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", "--model", "gpt2-micro", "--tp", "1", "--pp", "2",
           "--nproc", "2", "--steps", "5", "--seq-len", "32", "--batch-size", "4", "--max-files", "5",
           "--eval-windows", "8", "--sample-tokens", "8", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    m = json.loads((out / "metrics.json").read_text())
    assert (m["world_size"], m["tp"], m["pp"], m["dp"]) == (2, 1, 2, 1) and m["config"]["microbatches"] == 4
    assert len(m["loss"]) == 5 and all(math.isfinite(v) for v in m["loss"])
    assert math.isfinite(m["final_val_loss"]) and m["sample"] == ""
    whole = sum(p.numel() for p in build_model("gpt2-micro", 32, 0).parameters())
    assert m["parameters"] == whole, "every stage's parameters counted, the tied embedding once"
    assert "pp 2" in proc.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--tp", "2", "--pp", "3", "--nproc", "4"], "--tp 2 x --pp 3 = 6 does not divide --nproc 4"),
    (["--tp", "1", "--pp", "4", "--nproc", "4"], "the model has 2 layers, fewer than --pp 4 stages"),
    (["--tp", "1", "--pp", "2", "--nproc", "2", "--microbatches", "3"], "--microbatches 3 does not divide --batch-size 16"),
    (["--pp", "0"], "--pp must be >= 1, got 0"),
])
def test_bad_pipeline_shapes_refused_before_launch(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "gpt2-micro", *argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err
