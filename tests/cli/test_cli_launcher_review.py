"""The launcher's answers found by the last review: exit statuses, warnings and refusals before launch.

A failure names where to look:
- a SIGTERM of the launcher exits 130 (Ctrl-C's status) or 1 instead of 143, or Ctrl-C no longer
  130: ``outcome.signal_exit``, ``_report`` in cli/train_launch.py and sagemaker/launch.py;
- more ranks than cores on a CPU run launch without a word: ``launch.oversubscription``;
- ``run`` with a bad ``--nproc-per-node`` and a missing script names only the script:
  ``launch_ranks`` in sagemaker/launch.py;
- importing ``modelparallel.cli.__main__`` runs the command: its ``__name__`` guard;
- a run whose ``--out`` another live job writes into (its launcher's lock, or its ranks saving
  checkpoints) launches and overwrites that job's metrics.json: ``checks._other_job_problems``,
  ``out_lock``, ``train_launch.launch_ranks`` (which holds the lock while the ranks run).

The launches here are stood in for (``launch.torchrun``, ``launch.run_agent``) except in the SIGTERM
test, which starts one rank of a script that only sleeps.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import modelparallel.cli
from modelparallel import cpus
from modelparallel.cli import checks, launch, main, out_lock, outcome, status_dir

REPO = Path(__file__).resolve().parents[2]
RUN = ["--model", "gpt2-micro", "--tp", "2", "--nproc", "2", "--seq-len", "32", "--batch-size", "2",
       "--max-files", "5", "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0", "--steps", "4"]


def _env() -> dict[str, str]:
    ours = ("RANK", "WORLD_SIZE", "LOCAL_RANK", launch.LAUNCHER_PID_ENV)
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def test_sigterm_of_run_exits_143_with_one_line_and_takes_the_ranks_down(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, time\nopen('pid.tmp', 'w').write(str(os.getpid()))\nos.rename('pid.tmp', 'pid')\n"
                      "time.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "modelparallel", "run", "--nproc-per-node", "1", str(script)],
                                cwd=tmp_path, env={**_env(), "TMPDIR": str(tmp_path)}, stderr=subprocess.PIPE,
                                text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "pid").exists():
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.stderr.read()[-3000:]
        time.sleep(0.05)
    rank = int((tmp_path / "pid").read_text())
    launcher.send_signal(signal.SIGTERM)
    err = launcher.communicate(timeout=60)[1]
    assert launcher.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "modelparallel run: stopped by SIGTERM" and "Traceback" not in err, err
    assert status_dir.process_start(rank) is None  # the rank ended with its launcher


def test_run_reports_ctrl_c_as_130_and_sigterm_as_143(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from modelparallel.sagemaker.launch import _report

    assert _report(KeyboardInterrupt(), tmp_path, tmp_path / "log") == 130
    assert capsys.readouterr().err.strip() == "modelparallel run: interrupted"
    assert _report(SignalException("stopped", signal.SIGINT), tmp_path, tmp_path / "log") == 130
    capsys.readouterr()
    assert _report(SignalException("stopped", signal.SIGTERM), tmp_path, tmp_path / "log") == 143
    assert capsys.readouterr().err.strip() == "modelparallel run: stopped by SIGTERM"
    assert (outcome.signal_exit(signal.SIGHUP), outcome.signal_exit(None)) == (129, 130)


def test_train_reports_ctrl_c_as_130(tmp_path, capsys):
    from modelparallel.cli.train_launch import _report

    args = argparse.Namespace(out=tmp_path / "out")
    assert _report(args, KeyboardInterrupt(), tmp_path) == 130
    assert capsys.readouterr().err.strip().startswith("interrupted before the first step;")


@pytest.fixture
def cpu_machine(monkeypatch, tmp_path):
    """A CPU run on a machine of ``cores`` cores (set by the test), status directories in tmp_path."""
    monkeypatch.setenv("MODELPARALLEL_DEVICE", "cpu")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in ("RANK", "WORLD_SIZE", launch.LAUNCHER_PID_ENV):
        monkeypatch.delenv(name, raising=False)
    cores = {"n": 1}
    monkeypatch.setattr(cpus, "usable", lambda: cores["n"])
    return cores


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning" in line]


def test_train_warns_once_of_more_ranks_than_cores(cpu_machine, tmp_path, monkeypatch, capsys):
    """A warning, not a refusal: the ranks are launched. The launcher holds --out's lock meanwhile."""
    (tmp_path / "a.py").write_text("x = 1\n" * 200)
    out = tmp_path / "out"
    seen = []
    monkeypatch.setattr(launch, "torchrun", lambda nodes, argv, env: seen.append(out_lock.holder(out)))
    argv = ["train", *RUN, "--data", str(tmp_path / "a.py"), "--out", str(out)]
    assert main(argv) == 0
    assert _warnings(capsys.readouterr().err) == [
        "modelparallel train: warning: oversubscribed: 2 ranks on 1 core, expect slow steps; each rank gets one thread"]
    assert seen == [f"host={os.uname().nodename} pid={os.getpid()}"] and out_lock.holder(out) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert main(argv) == 0
    assert _warnings(capsys.readouterr().err)[0].endswith("each rank gets 3 threads (OMP_NUM_THREADS)")
    cpu_machine["n"] = 2
    assert main(argv) == 0 and _warnings(capsys.readouterr().err) == []


def test_run_warns_once_of_more_ranks_than_cores(cpu_machine, tmp_path, monkeypatch, capsys):
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    monkeypatch.setattr(launch, "run_agent", lambda args, nproc, env: None)
    assert main(["run", "--nproc-per-node", "3", str(script)]) == 0
    assert _warnings(capsys.readouterr().err) == [
        "modelparallel run: warning: oversubscribed: 3 ranks on 1 core, expect slow steps; each rank gets one thread"]
    cpu_machine["n"] = 3
    assert main(["run", "--nproc-per-node", "3", str(script)]) == 0 and _warnings(capsys.readouterr().err) == []


def test_run_names_a_bad_count_before_a_missing_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--nproc-per-node", "0", "missing.py"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "modelparallel run: error: --nproc-per-node must be at least 1, got 0",
        "modelparallel run: missing.py: no such script"]


def test_importing_the_rank_entry_point_runs_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(modelparallel.cli, "main", lambda *args: calls.append(args) or 0)
    monkeypatch.delitem(sys.modules, "modelparallel.cli.__main__", raising=False)
    importlib.import_module("modelparallel.cli.__main__")
    assert calls == []
    done = subprocess.run([sys.executable, "-m", "modelparallel.cli", "--help"], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: modelparallel "), done.stderr[-3000:]


def _refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    return err


def test_a_reader_only_resume_into_another_jobs_out_is_refused(tmp_path, capsys, monkeypatch):
    """The review's case: no --save-every, so the writer-lock check was skipped, and the run wrote
    its metrics.json over the other job's. That job is this process holding the checkpoints' lock."""
    from modelparallel.checkpoint.safety.lock import LOCK, DirectoryLock

    assert out_lock.CHECKPOINT_LOCK == LOCK
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch, "torchrun", lambda *args: None)  # were the check gone: no ranks started
    (tmp_path / "a.py").write_text("x = 1\n" * 200)
    argv = ["train", *RUN, "--data", str(tmp_path / "a.py"), "--out", str(tmp_path)]
    lock = DirectoryLock(tmp_path / "checkpoints").acquire()
    try:
        for extra in (["--resume", "auto"], []):  # a fresh run without saves would overwrite them too
            err = _refusal(argv + extra, capsys)
            assert f"--out {tmp_path}: another job is saving checkpoints into {tmp_path / 'checkpoints'} (host=" in err
            assert "this run would overwrite that job's metrics.json" in err, err
    finally:
        lock.release()
    assert checks._other_job_problems(argparse.Namespace(out=tmp_path, save_every=0)) == []


def test_an_out_another_launcher_holds_is_refused_but_not_by_its_own_ranks(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", launch.LAUNCHER_PID_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch, "torchrun", lambda *args: None)
    (tmp_path / "a.py").write_text("x = 1\n" * 200)
    fd, owner = out_lock.take(tmp_path)  # the other job's launcher
    assert owner is None and out_lock.take(tmp_path)[1] == f"host={os.uname().nodename} pid={os.getpid()}"
    try:
        err = _refusal(["train", *RUN, "--data", str(tmp_path / "a.py"), "--out", str(tmp_path)], capsys)
        assert f"--out {tmp_path}: another job is writing into it (host=" in err, err
        args = argparse.Namespace(out=tmp_path, save_every=0, node_rank=0)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert checks._other_job_problems(args) != []  # a rank of another launcher (torchrun)
        monkeypatch.setenv(launch.LAUNCHER_PID_ENV, str(os.getpid()))
        assert checks._other_job_problems(args) == []  # a rank of the launcher holding it
        for name in ("RANK", "WORLD_SIZE", launch.LAUNCHER_PID_ENV):
            monkeypatch.delenv(name)
        assert checks._other_job_problems(argparse.Namespace(out=tmp_path, save_every=0, node_rank=1)) == []
    finally:
        os.close(fd)
    assert out_lock.holder(tmp_path) is None  # a dead (here: closed) owner's lock goes with it


def test_the_cores_counted_are_the_ones_this_process_may_run_on(monkeypatch):
    """A container or ``taskset`` limits a process to some cores: the ranks' threads and the
    oversubscription warning count those, not the machine's (``cpus.usable``)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    monkeypatch.setenv("MODELPARALLEL_DEVICE", "cpu")
    assert cpus.usable() == 1
    assert launch.threads_per_rank(1) == 1
    assert launch.oversubscription(2).startswith("warning: oversubscribed: 2 ranks on 1 core")
    monkeypatch.delattr(os, "sched_getaffinity")  # a system without affinity: the machine's count
    assert cpus.usable() == 8 and launch.threads_per_rank(2) == 4 and launch.oversubscription(2) is None

