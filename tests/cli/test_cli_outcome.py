"""How the launcher tells a run's end from the ranks' records, without starting ranks.

A failure means the launcher names the wrong rank as the cause (a peer that only lost its
connection later), loses a traceback from the log, or prints a block that grows with the error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from modelparallel.cli.outcome import STATUS_ENV, Ending, failure_block, write_log


def _record(rank, t, kind="RuntimeError", message="boom", interrupted=False, step=7):
    return {"rank": rank, "time": t, "step": step, "stage": "training", "interrupted": interrupted,
            "type": kind, "message": message, "traceback": f"Traceback (rank {rank})\n{kind}: {message}\n"}


def test_the_earliest_error_is_the_cause_and_every_traceback_is_logged(tmp_path):
    status = tmp_path / "status"
    status.mkdir()
    records = [_record(1, 10.5, "RuntimeError", "Connection closed by peer"),
               _record(0, 10.0, "ValueError", "\n".join(f"line {i}" for i in range(30))),
               _record(3, 10.7, "RuntimeError", "Connection closed by peer")]
    for r in records:
        (status / f"rank{r['rank']}.json").write_text(json.dumps(r))
    (status / "rank9.json").write_text("{half a rec")  # a record cut short is skipped, not fatal
    ending = Ending.read(status, interrupted=False)
    assert [r["rank"] for r in ending.errors()] == [0, 1, 3] and not ending.interrupted
    log = write_log(tmp_path / "out" / "failure.log", ending.errors())
    text = log.read_text()
    assert all(f"Traceback (rank {r})" in text for r in (0, 1, 3)) and text.index("rank 0") < text.index("rank 1")
    block = failure_block(ending.errors()[0], log, 3).splitlines()
    assert block[0] == "modelparallel train failed: rank 0 at step 7"
    assert block[1] == "  ValueError: line 0" and "18 more lines in the log" in block[13]
    assert block[-2:] == ["  (2 other rank(s) failed after it)", f"  full tracebacks: {log}"]


def test_an_interrupted_rank_makes_the_run_interrupted(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps(_record(0, 1.0, "KeyboardInterrupt", "", True, step=12)))
    (tmp_path / "rank1.json").write_text(json.dumps(_record(1, 1.1, "RuntimeError", "peer gone", False, step=11)))
    ending = Ending.read(tmp_path, interrupted=False)
    assert ending.interrupted and ending.step() == 12


def _rank(status, code: str) -> subprocess.Popen:
    """A process standing for one rank our launcher started, running ``code`` after the imports."""
    env = {**os.environ, STATUS_ENV: str(status), "RANK": "0", "WORLD_SIZE": "1"}
    return subprocess.Popen([sys.executable, "-c", "import time\nfrom modelparallel.cli import outcome\n" + code],
                            env=env)


def test_a_rank_killed_by_sigterm_still_tells_its_step(tmp_path, capsys):
    """SIGTERM ends a rank without a record; the step it reached is in its step file, and the
    launcher's report says it rather than "before the first step"."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from modelparallel.cli.train_launch import _report

    rank = _rank(tmp_path, "outcome.at_step(2249)\noutcome.at_step(2250)\nprint('ready', flush=True)\n"
                 "time.sleep(600)")
    deadline = time.monotonic() + 120
    while not (tmp_path / "step0").exists() or int((tmp_path / "step0").read_bytes()) != 2250:
        assert time.monotonic() < deadline and rank.poll() is None
        time.sleep(0.05)
    rank.send_signal(signal.SIGTERM)
    assert rank.wait(timeout=60) == -signal.SIGTERM
    assert Ending.read(tmp_path, interrupted=False).step() == 2250
    args = argparse.Namespace(out=tmp_path / "out")
    assert _report(args, SignalException("stopped", signal.SIGTERM), tmp_path) == 143
    assert capsys.readouterr().err.strip().startswith("stopped by SIGTERM at step 2250;")


def test_a_job_that_exits_with_a_status_is_recorded_with_it(tmp_path):
    """A script's ``sys.exit(3)`` on one rank: recorded with its status (the cause), so the
    launcher names this rank, not a peer that lost its connection to it afterwards."""
    rank = _rank(tmp_path, "outcome.run_rank(lambda: 3)")
    assert rank.wait(timeout=120) == 3
    ending = Ending.read(tmp_path, interrupted=False)
    assert ending.errors()[0]["message"] == "exited with status 3" and ending.exit_code() == 3
