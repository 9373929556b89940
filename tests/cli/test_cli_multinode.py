"""Several machines: two ``modelparallel train`` launchers on 127.0.0.1, each a "node" of 2 ranks,
meet at one rendezvous endpoint and train TP=2 x DP=2 as one job.

A failure means ``--nnodes/--node-rank/--rdzv-endpoint`` do not reach torchrun's agent as a user
of ``torchrun`` would expect (the agents never meet, or form two jobs), or that the four ranks of
two agents do not compute what one agent of four computes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

RUN = ["--model", "gpt2-micro", "--tp", "2", "--steps", "3", "--seq-len", "32", "--batch-size", "2",
       "--max-files", "5", "--eval-windows", "2", "--eval-every", "0", "--sample-tokens", "0"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # both runs alike, whatever the machine's core count
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_of_two_train_as_one_agent_of_four(tmp_path):
    """Same global ranks, same TP groups and data-parallel batches, and every data-parallel
    reduction adds the same two values (a + b == b + a exactly), so the losses are equal, not
    merely close."""
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", *RUN]
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([*cmd, "--nproc", "2", "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint",
                               endpoint, "--out", str(tmp_path / f"node{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for i in range(2)]
    outputs = [p.communicate(timeout=400) for p in nodes]
    for p, (out, err) in zip(nodes, outputs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    assert "on this machine (node 1 of 2, 4 in all)" in outputs[1][1]
    two = json.loads((tmp_path / "node0" / "metrics.json").read_text())
    assert not (tmp_path / "node1" / "metrics.json").exists()  # rank 0 (on node 0) writes the artifacts

    one = subprocess.run([*cmd, "--nproc", "4", "--out", str(tmp_path / "single")], capture_output=True,
                         text=True, timeout=400, env=_env())
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-4000:]
    single = json.loads((tmp_path / "single" / "metrics.json").read_text())
    assert (two["world_size"], two["tp"], two["dp"]) == (4, 2, 2) == (single["world_size"], single["tp"], single["dp"])
    assert len(two["loss"]) == 3 and two["loss"] == single["loss"]
    assert two["final_val_loss"] == single["final_val_loss"]
