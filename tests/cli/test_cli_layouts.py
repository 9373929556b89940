"""``modelparallel train`` at every layout of one global batch trains to one process's losses.

A dense model at data parallel 2, tensor x data, pipeline x tensor, context x data and pipeline x
context parallel (world sizes 2 and 4) is given the global batch one process trains on
(``--batch-size`` is per data-parallel rank: the data-parallel ranks split one global batch,
``cli.data.WindowSampler``), with the same seed; every step's loss and the final validation loss
must equal the one-process run's within the rounding of a different reduction order. And a
checkpoint saved at pipeline x context parallel resumes on one process, continuing the
one-process run's losses.

Mixture-of-experts models are left out on purpose: SageMaker's default router balances the
tokens each rank routes, so its results depend on how the batch is split (docs/parallelism.md).

A failure points at the layout's library dimension (the test names the layout), or at
modelparallel/cli/train_job.py and cli/data.py (how a layout's ranks draw and share the batch).

Several machines: two launchers on 127.0.0.1, each a "node" of 2 ranks, meet at one rendezvous
endpoint and train tensor x data parallel as one job, to exactly the losses of the one agent of 4
above. A failure there means ``--nnodes/--node-rank/--rdzv-endpoint`` do not reach torchrun's agent
as a user of ``torchrun`` would expect (the agents never meet, or form two jobs), or that the four
ranks of two agents do not compute what one agent of four computes.

Each layout trains once per module (``layout_run``): the tensor x data run is also the one agent the
two agents must equal, and the pipeline x context run saves the checkpoint that one process resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from reference import training_rtol

STEPS = 4
GLOBAL_BATCH = 4
RUN = ["--model", "gpt2-micro", "--seq-len", "32", "--max-files", "5", "--eval-windows", "4", "--eval-every", "0",
       "--sample-tokens", "0"]

LAYOUTS = {  # name: (ranks, --tp, --pp, --cp); data parallel is the rest
    "dp2": (2, 1, 1, 1),
    "tp2 x dp2": (4, 2, 1, 1),
    "pp2 x tp2": (4, 2, 2, 1),
    "cp2 x dp2": (4, 1, 1, 2),
    "pp2 x cp2": (4, 1, 2, 2),
}


RESUMED = "pp2 x cp2"
"""The layout whose run also saves (at step 2) the checkpoint one process resumes."""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # every run alike, whatever the machine's core count
    return env


def _cmd(ranks: int, tp: int, pp: int, cp: int, *extra: str, nodes: int = 1) -> list[str]:
    """``modelparallel train`` of the global batch at a layout of ``ranks`` on ``nodes`` agents."""
    dp = ranks // (tp * pp * cp)
    return [sys.executable, "-m", "modelparallel.cli", "train", *RUN, "--nproc", str(ranks // nodes), "--tp", str(tp),
            "--pp", str(pp), "--cp", str(cp), "--batch-size", str(GLOBAL_BATCH // dp),
            "--microbatches", "2" if pp > 1 else "1", *extra]


def _train(out: Path, ranks: int, tp: int, pp: int, cp: int, *extra: str) -> dict:
    proc = subprocess.run([*_cmd(ranks, tp, pp, cp, *extra), "--out", str(out)], capture_output=True, text=True,
                          timeout=400, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return _train(tmp_path_factory.mktemp("one") / "run", 1, 1, 1, 1, "--steps", str(STEPS))


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory):
    """``layout_run(name)``: (out, metrics) of the layout's STEPS-step run, trained at its first use."""
    runs = {}

    def run(name: str) -> tuple[Path, dict]:
        if name not in runs:
            out = tmp_path_factory.mktemp("layout") / "run"
            save = ("--save-every", "2") if name == RESUMED else ()
            runs[name] = out, _train(out, *LAYOUTS[name], "--steps", str(STEPS), *save)
        return runs[name]

    return run


def _assert_same_losses(got: list[float], want: list[float], first: int, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=first):
        assert abs(g - w) / w < training_rtol(step), f"{what}: step {step} loss {g} vs one process {w}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_to_one_process_losses(name, one_process, layout_run):
    ranks, tp, pp, cp = LAYOUTS[name]
    m = layout_run(name)[1]
    assert (m["world_size"], m["tp"], m["pp"], m["cp"], m["dp"]) == (ranks, tp, pp, cp, ranks // (tp * pp * cp))
    _assert_same_losses(m["loss"], one_process["loss"], 0, name)
    rel = abs(m["final_val_loss"] - one_process["final_val_loss"]) / one_process["final_val_loss"]
    assert rel < training_rtol(STEPS), f"{name}: validation loss {m['final_val_loss']} vs {one_process['final_val_loss']}"


def test_checkpoint_of_one_layout_resumes_at_another(one_process, layout_run, tmp_path):
    """Saved at pipeline x context parallel (4 ranks, step 2 of the layout's run), resumed on one
    process: the resumed steps continue the one-process run (the checkpoint's pipeline stages and
    sequence halves make one model again)."""
    assert LAYOUTS[RESUMED][1:] == (1, 2, 2)
    out = tmp_path / "run"
    shutil.copytree(layout_run(RESUMED)[0], out)
    m = _train(out, 1, 1, 1, 1, "--steps", str(STEPS), "--resume-from", "step2")
    assert m["first_step"] == 2 and len(m["loss"]) == STEPS
    _assert_same_losses(m["loss"][2:], one_process["loss"][2:], 2, "pp2 x cp2 -> one process")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_of_two_train_as_one_agent_of_four(layout_run, tmp_path):
    """Same global ranks, same TP groups and data-parallel batches, and every data-parallel
    reduction adds the same two values (a + b == b + a exactly), so the losses are equal, not
    merely close."""
    name = "tp2 x dp2"
    ranks, tp, pp, cp = LAYOUTS[name]
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([*_cmd(ranks, tp, pp, cp, "--steps", str(STEPS), nodes=2), "--nnodes", "2",
                               "--node-rank", str(i), "--rdzv-endpoint", endpoint, "--out", str(tmp_path / f"node{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for i in range(2)]
    outputs = [p.communicate(timeout=400) for p in nodes]
    for p, (out, err) in zip(nodes, outputs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    assert "on this machine (node 1 of 2, 4 in all)" in outputs[1][1]
    two = json.loads((tmp_path / "node0" / "metrics.json").read_text())
    assert not (tmp_path / "node1" / "metrics.json").exists()  # rank 0 (on node 0) writes the artifacts

    single = layout_run(name)[1]
    assert (two["world_size"], two["tp"], two["dp"]) == (4, 2, 2) == (single["world_size"], single["tp"], single["dp"])
    assert len(two["loss"]) == STEPS and two["loss"] == single["loss"]
    assert two["final_val_loss"] == single["final_val_loss"]
