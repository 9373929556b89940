"""Review attacks on ``train --resume`` and the launchers that tests/cli/test_cli_resume.py and
its neighbours do not make. Where to look when one fails:

- a ``newest`` that is unreadable (a directory, a FIFO, a symlink) or names no partial checkpoint
  (``../x``, ``step4``), or is missing beside checkpoints ``train`` did not save, gives a
  traceback or lets ``--resume auto`` start from step 0: ``_newest`` in modelparallel/cli/resume.py;
  ``modelparallel inspect`` on such a ``newest``: ``scan`` in modelparallel/cli/inspect.py;
- an ``OUT/checkpoints`` file or a ``--seed`` out of range gets past the pre-launch check:
  ``checks._checkpoint_dir_problems``, ``train._range_problems``; a directory another live job
  saves into gets past it: ``checks._other_job_problems``, ``out_lock.holder``;
- a checkpoint whose user content claims another step than its tag is resumed at that step,
  skipping data the weights never saw: ``resume.saved_step`` (called by ``train_job.resume_run``);
- ``run -m`` with a missing module launches ranks: ``_no_module`` in modelparallel/sagemaker/launch.py;
- a rank killed by SIGKILL is not named as the cause (a peer's lost connection is):
  ``outcome.killed_ranks``.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelparallel.checkpoint.safety import commit
from modelparallel.cli import checks, main
from modelparallel.cli.resume import choose
from modelparallel.sagemaker.launch import _no_module

RUN = ["--model", "gpt2-micro", "--tp", "2", "--nproc", "2", "--seq-len", "32", "--batch-size", "2",
       "--max-files", "5", "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0"]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "modelparallel.cli", "train", *RUN, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run of 4 steps with checkpoints step2, step4 (``newest`` names step4)."""
    out = tmp_path_factory.mktemp("saved")
    proc = _train(out, "--steps", "4", "--save-every", "2")
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out


def _newest_dir(c: Path) -> None:
    (c / "newest").mkdir()


def _newest_fifo(c: Path) -> None:
    os.mkfifo(c / "newest")


def _newest_symlink(c: Path) -> None:
    (c / "newest").symlink_to(c / "step4_partial")


NEWEST = {"a directory": _newest_dir, "a FIFO": _newest_fifo, "a symlink": _newest_symlink,
          "'../x'": lambda c: (c / "newest").write_text("../x\n"),
          "'step4'": lambda c: (c / "newest").write_text("step4\n")}


@pytest.mark.parametrize("what", NEWEST)
def test_a_newest_that_names_no_partial_checkpoint_is_refused_before_launch(saved, tmp_path, capsys, what):
    out = tmp_path / "run"
    shutil.copytree(saved / "checkpoints", out / "checkpoints")
    (out / "checkpoints" / "newest").unlink()
    NEWEST[what](out / "checkpoints")
    for how in (["--resume", "auto"], ["--resume"]):  # auto never turns it into a fresh start
        with pytest.raises(SystemExit) as exc:
            main(["train", *RUN, "--out", str(out), "--steps", "8", *how])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err, err
        assert f"{out / 'checkpoints' / 'newest'}" in err and "saved: step4, step2" in err, err
        assert (what in err) if what.startswith("'") else ("cannot be read" in err and what in err), err


def test_inspect_reports_an_unreadable_newest(saved, tmp_path, capsys):
    """The tool for looking at damaged checkpoints says what is wrong with ``newest`` (was a
    traceback) and still lists the checkpoints."""
    out = tmp_path / "look"
    shutil.copytree(saved / "checkpoints", out)
    (out / "newest").unlink()
    os.mkfifo(out / "newest")
    assert main(["inspect", str(out)]) == 1
    text = capsys.readouterr().out
    assert f"newest: UNREADABLE: {out / 'newest'}: not a regular file (a FIFO)" in text and "step4_partial" in text


def test_resume_auto_without_newest_beside_only_other_tags_is_refused(saved, tmp_path):
    """No ``newest`` and only a checkpoint another script saved (``final``): not a fresh start."""
    out = tmp_path / "other"
    shutil.copytree(saved / "checkpoints" / "step4_partial", out / "checkpoints" / "final_partial")
    tag, problems = choose(out, "auto", None, 10, verify=True)
    assert tag is None and "newest is missing" in problems[0] and "saved: final" in problems[0], problems
    shutil.rmtree(out / "checkpoints" / "final_partial")
    assert choose(out, "auto", None, 10, verify=True) == (None, [])  # nothing there: a fresh start


def test_a_checkpoints_entry_that_is_a_file_is_refused_before_launch(tmp_path, capsys):
    """Else the ranks train up to the first save, which then fails."""
    (tmp_path / "checkpoints").write_text("not a directory")
    for how in (["--save-every", "2"], ["--resume", "auto", "--save-every", "2"], ["--resume"]):
        with pytest.raises(SystemExit) as exc:
            main(["train", *RUN, "--out", str(tmp_path), "--steps", "4", *how])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"{tmp_path / 'checkpoints'} exists and is not a directory" in err, err


def test_a_directory_another_live_job_saves_into_is_refused_before_launch(tmp_path, capsys):
    """Else the second run trains up to its first save, which then fails on the lock; the first
    job is this process holding the lock. Once it lets go, nothing is refused (a dead job's lock
    goes with it)."""
    from modelparallel.checkpoint.safety.lock import DirectoryLock

    lock = DirectoryLock(tmp_path / "checkpoints").acquire()
    try:
        with pytest.raises(SystemExit) as exc:
            main(["train", *RUN, "--out", str(tmp_path), "--steps", "4", "--save-every", "2"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"another job is saving checkpoints into {tmp_path / 'checkpoints'} " \
            f"(host=" in err and f"pid={os.getpid()})" in err, err
    finally:
        lock.release()
    assert checks._checkpoint_dir_problems(argparse.Namespace(out=tmp_path, save_every=2)) == []


@pytest.mark.parametrize("seed", [str(-2**31 - 1), str(2**64)])
def test_a_seed_out_of_range_is_refused_before_launch(tmp_path, capsys, seed):
    """2^64 passed the check, then every rank failed with "Overflow when unpacking long long"."""
    with pytest.raises(SystemExit) as exc:
        main(["train", *RUN, "--out", str(tmp_path / "run"), "--steps", "4", "--seed", seed])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--seed must be in {-2**31}..{2**32 - 1}, got {seed}" in err, err


def test_a_forged_step_in_the_user_content_is_refused(saved, tmp_path):
    """step4's user content rewritten to step 7, its manifest recomputed (as a forger would): the
    run would skip 3 steps of data with step 4's weights; it fails naming the checkpoint, saving
    nothing."""
    out = tmp_path / "forged"
    shutil.copytree(saved / "checkpoints", out / "checkpoints")
    ckpt = out / "checkpoints" / "step4_partial"
    content = torch.load(ckpt / "user_content.pt", weights_only=True)
    assert content["step"] == 4
    torch.save({**content, "step": 7}, ckpt / "user_content.pt")
    manifest = json.loads((ckpt / commit.MANIFEST).read_text())
    manifest["files"]["user_content.pt"] = commit.file_checksum(ckpt / "user_content.pt")
    (ckpt / commit.MANIFEST).write_text(json.dumps(manifest))
    proc = _train(out, "--steps", "10", "--save-every", "2", "--resume")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"{ckpt}: its user content says step 7, its tag step 4" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step*")) == ["step2_partial", "step4_partial"]


def test_run_refuses_a_missing_module_before_launch(tmp_path, capsys, monkeypatch):
    """``run -m`` as ``run script.py``: a name no rank could import is one line, before launch; a
    module in the current directory (first on the ranks' ``sys.path``) is found."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "review_here.py").write_text("x = 1\n")
    assert not _no_module("review_here") and not _no_module("json.tool")
    assert main(["run", "--nproc-per-node", "2", "-m", "review_missing_module.sub"]) == 2
    assert capsys.readouterr().err.strip() == "modelparallel run: -m review_missing_module.sub: no such module"
    assert not (tmp_path / "sagemaker").exists()  # nothing of a launch was made


def test_a_rank_killed_by_sigkill_is_named_as_the_cause(tmp_path):
    """Rank 1 dies as the out-of-memory killer kills (SIGKILL: no record); rank 0 then records
    a lost connection. The report names rank 1's death, not rank 0's consequence."""
    script = tmp_path / "die.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this checkout's package, from any directory
    proc = subprocess.run([sys.executable, "-m", "modelparallel.cli", "run", "--nproc-per-node", "2", "--standalone",
                           "--sagemaker-dir", str(tmp_path / "sm"), str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "modelparallel run failed: rank 1 during its run\n  ProcessExit: killed by SIGKILL" in proc.stderr, \
        proc.stderr[-3000:]
