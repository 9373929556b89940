"""Ordinary mistakes with the command line that used to end in a traceback, a silent wrong result,
a success exit status, or a directory left in /tmp for good.

A failure names the command's module: ``status_dir`` (leftover status directories of killed
launchers are swept, nothing else is), ``train_launch`` (an ``--out`` the checks passed but
mkdir refuses), ``convert`` (a source already in the target format), ``plan`` (a degree the
model's heads refuse), ``inspect`` (a directory holding no complete checkpoint), or ``main``
(a launched rank's Ctrl-C left to the launcher's one report).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from modelparallel.cli import inspect, main, status_dir
from modelparallel.cli.outcome import STATUS_ENV


def _dead_launchers_dir(parent) -> str:
    """A status directory made by a process that then ended without removing it (as SIGKILL does)."""
    code = "from modelparallel.cli import status_dir; print(status_dir.create('train'))"
    env = {**os.environ, "TMPDIR": str(parent)}
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_status_dirs_of_dead_launchers_are_swept(tmp_path, monkeypatch):
    dead = _dead_launchers_dir(tmp_path)
    assert os.path.dirname(dead) == str(tmp_path) and os.path.isdir(dead)
    (tmp_path / os.path.basename(dead) / "step0").write_text("3")
    me, start = os.getpid(), status_dir.process_start(os.getpid())
    alive = tmp_path / f"modelparallel-run-{me}-{start}-abc"
    reused = tmp_path / f"modelparallel-train-{me}-{start + 1}-abc"  # this pid, another process's start
    old_format = tmp_path / "modelparallel-train-2x0irs_y"  # no pid in the name: never guessed at
    target = tmp_path / "elsewhere"
    for d in (alive, reused, old_format, target):
        d.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / "modelparallel-train-1-1-abc"  # a link of the form, of no live launcher
    link.symlink_to(target)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = status_dir.create("train")  # a later launcher sweeps first
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not os.path.exists(dead) and not reused.exists(), left
    assert alive.is_dir() and old_format.is_dir() and (target / "keep").is_file() and link.is_symlink(), left
    assert made.is_dir() and made.parent == tmp_path
    assert status_dir.sweep(tmp_path) == []  # its own directory: its launcher (this process) is alive
    another_users = _dead_launchers_dir(tmp_path)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(another_users).st_uid + 1)
    assert status_dir.sweep(tmp_path) == [] and os.path.isdir(another_users)  # only this user's are swept


def test_out_that_mkdir_refuses_is_one_line(capsys):
    out = "/proc/modelparallel-cannot-be-here/run"  # the checks pass it as root; mkdir does not
    try:  # not root: the checks refuse it first (exit status 2 by SystemExit)
        code = main(["train", "--model", "gpt2-micro", "--steps", "2", "--seq-len", "32", "--max-files", "2",
                     "--out", out])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and f"--out {out}" in err and "Traceback" not in err, err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=16)).save_pretrained(path)
    return path


def test_convert_refuses_a_source_already_in_the_target_format(hf_dir, tmp_path, capsys):
    assert main(["convert", str(hf_dir), str(tmp_path / "again"), "--to", "hf"]) == 2
    assert "already in the Hugging Face format" in capsys.readouterr().err
    assert main(["convert", str(hf_dir), str(tmp_path / "dist"), "--to", "distributed"]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "dist"), str(tmp_path / "twice"), "--to", "distributed"]) == 2
    err = capsys.readouterr().err
    assert "already in the distributed format" in err and "Traceback" not in err, err
    assert not (tmp_path / "again").exists() and not (tmp_path / "twice").exists()


def test_plan_refuses_a_degree_the_heads_do_not_divide(hf_dir, capsys):
    assert main(["plan", str(hf_dir), "--tp", "3"]) == 2
    assert "4 attention heads, not divisible by --tp 3" in capsys.readouterr().err
    assert main(["plan", str(hf_dir), "--tp", "4"]) == 0


def test_inspect_of_a_checkpoint_without_its_manifest_fails(tmp_path, capsys):
    cut_short = tmp_path / "step8_partial"  # a save killed before its manifest was written
    (cut_short / "model").mkdir(parents=True)
    (cut_short / "model" / "__0_0.distcp").write_bytes(b"\0" * 64)
    assert main(["inspect", str(cut_short)]) == 1
    assert "no complete checkpoint in" in capsys.readouterr().out


@pytest.mark.parametrize("launched", [False, True])
@pytest.mark.parametrize("where", ["importing", "running"])
def test_ctrl_c_in_a_launched_rank_is_left_to_the_launcher(tmp_path, capsys, monkeypatch, launched, where):
    """Ctrl-C is status 130 and one line, also while the parser's modules are imported (it was a
    traceback), and no line at all from a rank of our launcher, which reports once."""
    import modelparallel.cli

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(*((modelparallel.cli, "build_parser") if where == "importing" else (inspect, "run")),
                        interrupted)
    if launched:
        monkeypatch.setenv(STATUS_ENV, str(tmp_path))
    else:
        monkeypatch.delenv(STATUS_ENV, raising=False)
    try:
        code = main(["inspect", str(tmp_path)])
    except KeyboardInterrupt:  # pytest would take it for the user's and stop the session
        pytest.fail("Ctrl-C escaped main as a KeyboardInterrupt")
    assert code == 130
    err = capsys.readouterr().err
    assert err.strip() == ("" if launched else "modelparallel inspect: interrupted"), err


def test_a_tilde_the_shell_left_is_the_home_directory(hf_dir, tmp_path, monkeypatch, capsys):
    """``--out=~/runs`` reaches the command with its ``~`` (a shell expands only a word's start)."""
    from modelparallel.cli import build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    args = build_parser().parse_args(["train", "--out=~/runs", "--data=~/text", "--model=~/model"])
    assert (args.out, args.data, args.model) == (tmp_path / "runs", [str(tmp_path / "text")], str(tmp_path / "model"))
    assert main(["convert", str(hf_dir), "--to", "distributed", "~/dist"]) == 0
    assert (tmp_path / "dist" / "model.safetensors").is_file() and not (tmp_path / "cwd" / "~").exists()
    assert build_parser().parse_args(["plan", "~/m", "--save", "~/p.py"]).save == tmp_path / "p.py"
    assert build_parser().parse_args(["inspect", "~/c"]).path == tmp_path / "c"


def test_the_corpus_is_regular_files_only(tmp_path):
    """A dangling link (an editor's lock file) failed the check with a traceback; a FIFO named
    ``*.py`` hung every rank reading it."""
    import os

    from modelparallel.cli.corpus import find_text_files

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / ".#b.py").symlink_to(tmp_path / "gone")
    os.mkfifo(tmp_path / "c.py")
    (tmp_path / "d.py").mkdir()
    assert find_text_files([tmp_path]) == [tmp_path / "a.py"]


def test_the_agents_signal_handlers_end_with_it(monkeypatch):
    """torchrun's agent raises its own exception on SIGINT; left installed, a second Ctrl-C while
    the launcher reported ended it in a traceback (status 1) instead of status 130."""
    import signal

    import torch.distributed.run

    from modelparallel.cli import launch

    def agent(args):
        signal.signal(signal.SIGINT, lambda *_: None)  # as its ``start`` does for each signal
        signal.signal(signal.SIGTERM, lambda *_: None)
        raise RuntimeError("ranks failed")

    monkeypatch.setattr(torch.distributed.run, "run", agent)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert isinstance(launch.run_agent(None, 2, {}), RuntimeError)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_rank_that_exits_without_a_record_is_one_block(tmp_path):
    """``os._exit(5)`` in a rank (no record): the report is one short block with its status,
    not torchrun's 20-line failure report (``modelparallel run`` can return the 5)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from modelparallel.cli.outcome import failure_block, from_torchrun

    failed = ChildFailedError("modelparallel.cli", {0: ProcessFailure(0, 123, 5, str(tmp_path / "none.json"))})
    record = from_torchrun(failed)
    assert (record["rank"], record["exit_code"]) == (0, 5) and "exited with code 5" in record["message"]
    assert len(failure_block(record, None, 1).splitlines()) == 2
