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
])
def test_bad_arguments_are_reported_before_launch(tmp_path, capsys, args, needle):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("x = 1\n" * 666 + "xxxx")  # 4000 bytes
    (tmp_path / "FILE").write_text("not a directory")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "gpt2-micro", "--data", str(data), "--steps", "4", "--seq-len", "32", *out, *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


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
