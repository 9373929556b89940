"""SIGKILL of one rank at seeded random points of checkpoint saves and retention (12 trials
synchronous, 10 for each asynchronous mode: the kill points and recovery code are shared; the
asynchronous trials add the background writer's moments), synchronous and asynchronous (partial
checkpoints, and full ones saved asynchronously).

A failure means a killed save left something visible that is not a complete checkpoint, the
newest visible checkpoint no longer loads bit-exactly, a resumed job did not get back what was
saved, or the surviving rank hung instead of raising. The failing trial's record names the kill
point; each rank's log is in ``<tmp>/logs/trial<N>.rank<R>.log``. The trials live in
``tests/checkpoint/checkpoint_kill.py`` (a script: one driver process forks a 2-rank job per trial).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TRIALS = {"sync": 12, "async": 10, "async-full": 10}


@pytest.mark.parametrize("mode", ["sync", "async", "async-full"])
def test_kill_a_rank_during_save_and_retention_leaves_newest_loadable(tmp_path, mode):
    """``async``: the saves are asynchronous, so the kills land in the background writer;
    ``async-full``: asynchronous full checkpoints (rank 0's background write)."""
    script = Path(__file__).with_name("checkpoint_kill.py")
    out = tmp_path / "summary.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "work"), "--trials", str(TRIALS[mode]),
                           "--seed", "0", "--json", str(out)] + (["--async"] if mode.startswith("async") else [])
                          + (["--full"] if mode.endswith("full") else []), env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["failed"] == 0 and summary["killed"] == TRIALS[mode]
    kinds = {r["mode"] for r in summary["records"]}
    assert {"event", "timer", "none"} <= kinds
    assert summary["max_survivor_exit_s"] < 30, "a survivor took too long to notice its peer died"
