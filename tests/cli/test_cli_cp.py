"""``modelparallel train --cp``: context parallelism from the command line.

Launch shapes and sequence lengths that --cp cannot take are refused before launch, exit status 2.
A failure points at modelparallel/cli/train.py (checks). Training at --cp 2 against one process,
and a checkpoint saved under context parallelism resumed on one process:
tests/cli/test_cli_layouts.py.
"""

from __future__ import annotations

import pytest

from modelparallel.cli import main

RUN = ["--model", "gpt2-micro", "--tp", "1", "--seq-len", "32", "--batch-size", "2", "--max-files", "5",
       "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0"]


@pytest.mark.parametrize("extra, problem", [
    (["--cp", "3", "--nproc", "4"], "--tp 1 x --cp 3 = 3 does not divide --nproc 4"),
    (["--cp", "2", "--nproc", "2", "--seq-len", "30"], "--seq-len 30 is not divisible by 2 x --cp = 4"),
    (["--cp", "0"], "--cp must be >= 1, got 0"),
])
def test_cp_arguments_checked_before_launch(extra, problem, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", *RUN, "--out", str(tmp_path), *extra])
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err
