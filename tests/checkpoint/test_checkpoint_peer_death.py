"""A rank SIGKILLed in the middle of a checkpoint save or load: the survivor raises at once, and
its error says which rank died (not a raw gloo "Connection reset by peer"); a rank dead before the
first asynchronous save creates its background group fails the survivor within the job's timeout
(not PyTorch's 30-minute default for new groups: ``compat.default_group_timeout``).

A failure means the survivor hung, or the error does not name rank 1 (modelparallel/checkpoint/
errors.py: ``agree`` and its roll call through the job's store). The job runs in
``peer_death.py`` (a script that forks its two ranks).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _survivor(tmp_path, phase: str) -> dict:
    """What rank 0 raised (``message``) and after how many seconds, in ``peer_death.py``."""
    script = Path(__file__).with_name("peer_death.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), phase], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("phase", ["save", "load"])
def test_a_killed_peer_is_named_by_the_survivor(tmp_path, phase):
    result = _survivor(tmp_path, phase)
    first = (result["message"] or "").splitlines()[0]
    assert first.startswith("CheckpointError: rank 1 died or stopped answering (rank 0, during checkpoint"), \
        result["message"]
    assert result["seconds"] < 60, result


def test_a_peer_dead_before_the_background_group_fails_the_survivor_within_the_timeout(tmp_path):
    result = _survivor(tmp_path, "async-group")
    assert result["message"] is not None and "seconds" in result, result
    assert result["seconds"] < 40, result  # the job's timeout is 10 s; PyTorch's default 30 minutes
