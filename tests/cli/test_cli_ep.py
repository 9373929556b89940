"""``modelparallel train --ep``: a mixture-of-experts preset trained end to end with expert
parallelism, and ``--ep`` problems reported before launch (exit status 2, no rank started).

A failure in the run means the CLI does not pass ``--ep`` to ``smp.init``
(modelparallel/cli/train_job.py) or a Mixtral preset does not build; in the refusals, that
modelparallel/cli/presets.py ``expert_problems`` or train.py's world check changed.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from modelparallel.cli import main


def test_mixtral_preset_trains_with_expert_parallelism(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", "--model", "mixtral-micro", "--tp", "1", "--ep", "2",
           "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--max-files", "5", "--eval-windows", "5",
           "--sample-tokens", "4", "--out", str(out)]  # --nproc defaults to tp x ep = 2; 5 windows: 3 + 2
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "(tp 1, ep 2, dp 2" in proc.stderr, proc.stderr[-2000:]
    m = json.loads((out / "metrics.json").read_text())
    assert (m["world_size"], m["tp"], m["ep"], m["dp"]) == (2, 1, 2, 2)
    assert len(m["loss"]) == 4 and all(math.isfinite(v) for v in m["loss"]) and math.isfinite(m["final_val_loss"])


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt2-micro", "--ep", "2", "--tp", "1"], "--ep 2 needs a mixture-of-experts model"),
    (["--model", "mixtral-micro", "--ep", "3", "--tp", "1"], "the model has 4 experts per layer, not divisible by --ep 3"),
    (["--model", "mixtral-micro", "--ep", "2", "--tp", "2", "--nproc", "2"],
     "--tp 2 x --ep 2 does not divide --nproc 2 (expert-parallel ranks are data-parallel ranks)"),
    (["--model", "mixtral-micro", "--ep", "0"], "--ep must be >= 1, got 0"),
])
def test_ep_problems_are_reported_before_launch(tmp_path, capsys, args, message):
    """In this process, as test_cli_cp.py's refusals: the checks run in the launcher before any
    rank starts, so ``main`` exits with status 2 and the message on stderr (a fresh interpreter
    per case would only add its start-up)."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", *args, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err[-2000:]
