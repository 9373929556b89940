"""``modelparallel train --dtype``: a two-rank fp16 run trains with fp32 master weights and
dynamic loss scaling end to end. A failure here, with the mixed-precision tests passing, means
the option is not passed on to ``smp.init`` / ``DistributedOptimizer``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys


def test_train_command_fp16(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", "--model", "gpt2-micro", "--tp", "2",
           "--nproc", "2", "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--max-files", "5",
           "--eval-windows", "2", "--sample-tokens", "4", "--dtype", "fp16", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["config"]["dtype"] == "fp16"
    assert len(m["loss"]) == 4 and all(math.isfinite(v) for v in m["loss"])
    assert m["loss"][-1] < m["loss"][0]
