"""The training-job environment SageMaker gives a script, given outside SageMaker.

SageMaker scripts read their paths and sizes from environment variables, often as argparse
defaults evaluated at start (``default=os.environ["SM_CHANNEL_TRAIN"]``), so a missing one is a
``KeyError`` before anything runs. Each rank started by ``modelparallel run`` gets the ones it
lacks, laid out like SageMaker's ``/opt/ml`` under one local directory (``--sagemaker-dir``,
default ``./sagemaker``); variables already set are kept, ``--channel NAME=DIR`` sets a channel:

============================  ==========================================================
``SM_MODEL_DIR``              ``DIR/model`` (created)
``SM_OUTPUT_DIR``             ``DIR/output`` (created)
``SM_OUTPUT_DATA_DIR``        ``DIR/output/data`` (created)
``SM_CHANNEL_TRAIN``/``TEST`` ``DIR/input/data/train`` / ``test`` (not created: data goes there)
``SM_CHANNELS``               JSON list of the channel names
``SM_NUM_GPUS``               CUDA devices, or on a CPU-only machine the ranks per machine
``SM_NUM_CPUS``               ``os.cpu_count()``
``SM_HOSTS``                  JSON list ``["algo-1", ..., "algo-N"]``, one per machine
``SM_CURRENT_HOST``           ``algo-<node rank + 1>``
============================  ==========================================================

On a machine without CUDA, ``torch.cuda.set_device(i)`` (which the scripts call with
``smp.local_rank()``) becomes a no-op for ``0 <= i < ranks per machine``: the rank runs on the CPU,
as ``smp.init`` chose. Nothing else of ``torch.cuda`` is changed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger("modelparallel")

DIR_ENV = "MODELPARALLEL_SAGEMAKER_DIR"
"""Where the launcher passes ``--sagemaker-dir`` (made absolute) to its ranks."""

DEFAULT_DIR = "sagemaker"
DEFAULT_CHANNELS = ("train", "test")


def parse_channel(text: str) -> tuple[str, str]:
    """``NAME=DIR`` -> (``SM_CHANNEL_NAME``, absolute DIR); argparse reports a ValueError."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"--channel takes NAME=DIR, got {text!r}")
    return f"SM_CHANNEL_{name.upper()}", str(Path(path).absolute())


def channel_env(channels: list[tuple[str, str]]) -> dict[str, str]:
    """The environment ``--channel`` flags set (over anything inherited)."""
    return dict(channels)


def _hosts(environ) -> tuple[int, int]:
    """(machines, this machine's index) from torchrun's variables (1, 0 outside a launcher)."""
    local = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(environ.get("WORLD_SIZE", str(local)))
    return max(1, world // max(1, local)), int(environ.get("GROUP_RANK", "0"))


def defaults(environ, root: Path) -> dict[str, str]:
    """Every SageMaker variable this module gives, with its default for this rank."""
    import torch

    data = root / "input" / "data"
    channels = sorted({k[len("SM_CHANNEL_"):].lower() for k in environ if k.startswith("SM_CHANNEL_")}
                      | set(DEFAULT_CHANNELS))
    machines, node = _hosts(environ)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else int(environ.get("LOCAL_WORLD_SIZE", "1"))
    out = {"SM_MODEL_DIR": str(root / "model"), "SM_OUTPUT_DIR": str(root / "output"),
           "SM_OUTPUT_DATA_DIR": str(root / "output" / "data"), "SM_CHANNELS": json.dumps(channels),
           "SM_NUM_GPUS": str(gpus), "SM_NUM_CPUS": str(os.cpu_count() or 1),
           "SM_HOSTS": json.dumps([f"algo-{i + 1}" for i in range(machines)]), "SM_CURRENT_HOST": f"algo-{node + 1}"}
    out.update({f"SM_CHANNEL_{name.upper()}": str(data / name) for name in channels})
    return out


def apply(environ=None) -> dict[str, str]:
    """Set the SageMaker variables ``environ`` (default ``os.environ``) lacks; returns what was
    set. The output directories are created, as SageMaker does."""
    environ = os.environ if environ is None else environ
    root = Path(environ.get(DIR_ENV, DEFAULT_DIR)).absolute()
    added = {k: v for k, v in defaults(environ, root).items() if k not in environ}
    environ.update(added)
    for key in ("SM_MODEL_DIR", "SM_OUTPUT_DIR", "SM_OUTPUT_DATA_DIR"):
        Path(environ[key]).mkdir(parents=True, exist_ok=True)
    return added


def cpu_set_device() -> None:
    """On a machine without CUDA, let ``torch.cuda.set_device(local rank)`` pass (see above)."""
    import torch

    if torch.cuda.is_available():
        return
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    real = torch.cuda.set_device

    def set_device(device) -> None:
        index = device.index if isinstance(device, torch.device) else device
        if isinstance(index, int) and 0 <= index < ranks:
            return
        real(device)  # outside the ranks' indices: torch's own error

    torch.cuda.set_device = set_device

