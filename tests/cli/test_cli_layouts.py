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
"""

from __future__ import annotations

import json
import os
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


def _train(out: Path, ranks: int, tp: int, pp: int, cp: int, *extra: str) -> dict:
    dp = ranks // (tp * pp * cp)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "modelparallel.cli", "train", *RUN, "--nproc", str(ranks), "--tp", str(tp),
           "--pp", str(pp), "--cp", str(cp), "--batch-size", str(GLOBAL_BATCH // dp),
           "--microbatches", "2" if pp > 1 else "1", "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return _train(tmp_path_factory.mktemp("one") / "run", 1, 1, 1, 1, "--steps", str(STEPS))


def _assert_same_losses(got: list[float], want: list[float], first: int, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=first):
        assert abs(g - w) / w < training_rtol(step), f"{what}: step {step} loss {g} vs one process {w}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_to_one_process_losses(name, one_process, tmp_path):
    ranks, tp, pp, cp = LAYOUTS[name]
    m = _train(tmp_path / "run", ranks, tp, pp, cp, "--steps", str(STEPS))
    assert (m["world_size"], m["tp"], m["pp"], m["cp"], m["dp"]) == (ranks, tp, pp, cp, ranks // (tp * pp * cp))
    _assert_same_losses(m["loss"], one_process["loss"], 0, name)
    rel = abs(m["final_val_loss"] - one_process["final_val_loss"]) / one_process["final_val_loss"]
    assert rel < training_rtol(STEPS), f"{name}: validation loss {m['final_val_loss']} vs {one_process['final_val_loss']}"


def test_checkpoint_of_one_layout_resumes_at_another(one_process, tmp_path):
    """Saved at pipeline x context parallel (4 ranks), resumed on one process: the resumed steps
    continue the one-process run (the checkpoint's pipeline stages and sequence halves make one
    model again)."""
    out = tmp_path / "run"
    _train(out, 4, 1, 2, 2, "--steps", "2", "--save-every", "2")
    m = _train(out, 1, 1, 1, 1, "--steps", str(STEPS), "--resume")
    assert m["first_step"] == 2 and len(m["loss"]) == STEPS
    _assert_same_losses(m["loss"][2:], one_process["loss"][2:], 2, "pp2 x cp2 -> one process")
