"""Shared test set-up: multi-rank checks go through ``harness.run``; one thread per process unless
``OMP_NUM_THREADS`` asks for more (other thread counts sum in other orders: the tolerances in
``reference.py`` must hold for all of them).

The suite is a CPU suite, also on a machine with GPUs: ``MODELPARALLEL_DEVICE=cpu`` keeps every
in-process job on CPU and gloo, and ``CUDA_VISIBLE_DEVICES=""`` hides the GPUs from every process
a test starts (harness ranks, CLI runs, scripts that call ``torch.cuda`` themselves). CUDA is
initialized here first when present, so this process still sees its GPUs for the tests marked
``gpu`` (tests/gpu), which ask for ``cuda`` explicitly; without CUDA they are skipped.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

GPUS = 0
if torch.cuda.is_available():
    torch.cuda.init()  # binds this process to the GPUs before they are hidden from its children
    GPUS = torch.cuda.device_count()
VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")
"""The machine's own setting, for the ``gpu`` tests' subprocesses (None: unset)."""
os.environ["MODELPARALLEL_DEVICE"] = "cpu"
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    if GPUS:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
