"""Launched runs that end badly: the launcher killed, a loss that stops being a number, a script
that exits with a status on one rank.

A failure means ranks outlive a killed launcher (``launch.die_with_launcher``, called first in
each rank), a diverged run exits 0 (``checks.finite_loss`` in the training loop), or the report
names a peer that only lost its connection instead of the rank that exited first
(``outcome.run_rank`` records a non-zero status).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

RUN = ["--model", "gpt2-micro", "--tp", "2", "--nproc", "2", "--seq-len", "32", "--batch-size", "2",
       "--max-files", "3", "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0"]


def _env(marker: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["MP_TEST_MARKER"] = marker
    return env


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes (not zombies) whose environment holds ``MP_TEST_MARKER=marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"MP_TEST_MARKER={marker}".encode() in (entry / "environ").read_bytes() \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL of the launcher (no handler, no forwarding) mid-training: its ranks are gone within
    seconds and save nothing more."""
    marker, out = uuid.uuid4().hex, tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "modelparallel.cli", "train", *RUN, "--steps", "100000",
                                 "--save-every", "2", "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(marker))
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "newest").exists():
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    ranks = [p for p in _processes_with(marker) if p != launcher.pid]
    assert len(ranks) == 2, ranks
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _processes_with(marker)
    for pid in left:  # never leave them running, whatever the outcome
        os.kill(pid, signal.SIGKILL)
    assert left == []
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    time.sleep(2)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == saved


def test_a_loss_that_stops_being_a_number_stops_the_run(tmp_path):
    """--lr 1e30 (finite, so accepted) throws the weights past fp32's range in one AdamW step:
    the next loss is NaN, and the run stops there with one block and exit status 1."""
    proc = subprocess.run([sys.executable, "-m", "modelparallel.cli", "train", *RUN, "--steps", "20", "--lr", "1e30",
                           "--warmup", "0", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    block = proc.stderr[proc.stderr.index("modelparallel train failed"):].splitlines()
    assert block[0].startswith("modelparallel train failed: rank ") and " at step " in block[0], block
    assert "NonFiniteLoss: the training loss is nan at step" in block[1] and "lower --lr" in block[1], block
    assert not (tmp_path / "run" / "metrics.json").exists() and "Traceback" not in proc.stderr


def test_a_script_exiting_with_a_status_on_rank_0_is_the_reported_cause(tmp_path):
    """Rank 0 ``sys.exit(3)``, rank 1 then loses its connection in a barrier: the report names
    rank 0 and its status, and ``modelparallel run`` exits with that status."""
    script = tmp_path / "exits.py"
    script.write_text("import sys\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "dist.barrier()\nif dist.get_rank() == 0:\n    sys.exit(3)\ndist.barrier()\n")
    proc = subprocess.run([sys.executable, "-m", "modelparallel.run", "--nproc-per-node", "2", "--sagemaker-dir",
                           str(tmp_path / "sm"), str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"modelparallel run failed: rank 0 during {script}" in proc.stderr, proc.stderr[-3000:]
    assert "SystemExit: exited with status 3" in proc.stderr


def test_a_rank_whose_launcher_died_before_it_started_exits(tmp_path):
    """The launcher's pid is checked after ``PR_SET_PDEATHSIG``: a rank whose parent is not the
    launcher that started it (the launcher died first: the rank was re-parented) exits at once."""
    code = "from modelparallel.cli.launch import die_with_launcher\ndie_with_launcher()\nprint('alive')"
    for launcher, alive in ((os.getpid(), True), (1, False)):
        env = {**_env(), "RANK": "0", "WORLD_SIZE": "1", "MODELPARALLEL_CLI_LAUNCHER": str(launcher)}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert (proc.returncode == 0 and proc.stdout == "alive\n") if alive else \
            (proc.returncode == 1 and proc.stdout == ""), (launcher, proc.stdout, proc.stderr[-2000:])
