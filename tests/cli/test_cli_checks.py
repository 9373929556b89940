"""Arguments of ``modelparallel train`` that used to fail with a traceback, or only after the
ranks had started, and the progress display in a log.

A failure in the first test means a bad argument is no longer reported once before launch
(exit status 2, one line naming the option): look at modelparallel/cli/train.py ``check_args``.
A failure in the progress tests means a redirected log gets more than one progress line every
few seconds, or misses the last step (modelparallel/cli/progress.py).
"""

from __future__ import annotations

import io

import pytest

from modelparallel.cli import main
from modelparallel.cli.progress import LineProgress, progress


@pytest.mark.parametrize("args,needle", [
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--keep", "0", "--save-every", "2"], "--keep must be >= 1, got 0"),
    (["--max-files", "0"], "--max-files must be >= 1, got 0"),
    (["--seq-len", "5000"], "--seq-len 5000: the corpus (1 file(s), 4000 bytes) cannot hold"),
    (["--out", "FILE"], "is a file; it must be a directory"),
    (["--out", "FILE/run"], "FILE is a file, so no directory can be created under it"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number, got nan"),
    (["--weight-decay", "-5"], "--weight-decay must be >= 0, got -5.0"),
    (["--max-bytes", "nan"], "--max-bytes must be a finite number, got nan"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--temperature", "1e-300"], "--temperature 1e-300 is below 0.001"),
    (["--max-bytes", "0.5"], "--max-bytes must be 0 (no limit) or at least 1, got 0.5"),
    (["--sample-tokens", "1021"], "--sample-tokens 1021: with the prompt's 4 token(s) the sample would reach 1025 "
                                  "positions, beyond the model's 1024"),
    (["--rdzv-endpoint", ":29500"], "--rdzv-endpoint :29500: no host before the port"),
    (["--rdzv-endpoint", "host:99999"], "--rdzv-endpoint host:99999: the port must be in 1..65535, got 99999"),
    (["--seq-len", "100000"], "--seq-len 100000 exceeds the 8192 positions a preset model (gpt2-micro) can have"),
])
def test_bad_arguments_are_reported_before_launch(tmp_path, capsys, args, needle):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("x = 1\n" * 666 + "xxxx")  # 4000 bytes
    (tmp_path / "FILE").write_text("not a directory")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    needle = needle.replace("FILE", str(tmp_path / "FILE"))
    out = [] if "--out" in args else ["--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "gpt2-micro", "--data", str(data), "--steps", "4", "--seq-len", "32", *out, *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_an_out_on_a_read_only_mount_is_one_line(tmp_path, capsys, monkeypatch):
    """What the kernel answers for a read-only mount (EROFS: not writable, even for root),
    reproduced for ``tmp_path`` alone: this machine has no read-only mount a test may use."""
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path) and mode & os.W_OK
                        else real(p, mode, **kw))
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "gpt2-micro", "--steps", "4", "--seq-len", "32", "--max-files", "2",
              "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert f"--out {tmp_path / 'run'}: {tmp_path} is not writable" in err, err


def test_run_refuses_a_missing_script_before_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    assert main(["run", "--nproc-per-node", "2", "missing.py", "--lr", "1"]) == 2
    assert capsys.readouterr().err.strip() == "modelparallel run: missing.py: no such script"
    assert main(["run", "adir"]) == 2
    assert "adir: is a directory, not a script" in capsys.readouterr().err
    assert not (tmp_path / "sagemaker").exists()  # nothing of a launch was made


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_in_a_log_is_a_line_every_few_seconds():
    clock, log = Clock(), io.StringIO()
    bar = LineProgress(total=1000, initial=0, desc="train", stream=log, every_s=10.0, clock=clock, out=log)
    for step in range(1000):  # 1000 steps over 100 s: a line every 10 s at most, and the last step
        clock.now = step * 0.1
        bar.set_postfix(loss=f"{step:.3f}", refresh=False)
        bar.update()
        if step == 500:
            bar.write("step 501: saved checkpoint")
    bar.close()
    lines = log.getvalue().splitlines()
    progress_lines = [line for line in lines if line.startswith("train step ")]
    assert 9 <= len(progress_lines) <= 11, lines
    assert progress_lines[-1] == "train step 1000/1000 (100%): loss 999.000"
    assert "step 501: saved checkpoint" in lines and "\r" not in log.getvalue()


def test_a_terminal_gets_the_bar_and_a_log_gets_lines():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress(10, 0, "train", False, Tty()), LineProgress)  # tqdm's bar
    assert isinstance(progress(10, 0, "train", False, io.StringIO()), LineProgress)
    quiet = io.StringIO()
    bar = progress(10, 0, "train", True, quiet)
    bar.update(10)
    bar.close()
    assert quiet.getvalue() == ""
