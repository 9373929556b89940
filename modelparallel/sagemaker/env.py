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
``SM_NUM_CPUS``               the cores this process may run on (``cpus.usable``)
``SM_HOSTS``                  JSON list ``["algo-1", ..., "algo-N"]``, one per machine
``SM_CURRENT_HOST``           ``algo-<node rank + 1>``
============================  ==========================================================

On a machine without CUDA (``cpu_cuda_calls``), the CUDA calls SageMaker's scripts make around
their training steps do what they mean there: ``torch.cuda.set_device(i)`` (called with
``smp.local_rank()``) is a no-op for ``0 <= i < ranks per machine`` (the rank runs on the CPU, as
``smp.init`` chose); ``torch.cuda.synchronize()`` returns at once (no device work is queued, a
CPU step is done when its call returns); ``torch.cuda.nvtx`` markers mark nothing (no GPU
profiler is attached); ``torch.cuda.reset_peak_memory_stats()`` resets nothing (the memory
counters are 0 without CUDA). ``torch.cuda.device_count()`` stays 0, as torch says; a script
that divides by it fails with ``device_count_hint``'s message, which names the fix. Nothing else
of ``torch.cuda`` is changed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from .. import cpus

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
           "SM_NUM_GPUS": str(gpus), "SM_NUM_CPUS": str(cpus.usable()),
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


def cpu_cuda_calls() -> Callable[[], None]:
    """On a machine without CUDA, give the CUDA calls above their CPU meaning (see the module doc).

    Returns:
        A function putting torch's own calls back (a process that runs more than one script).
    """
    import torch

    if torch.cuda.is_available():
        return lambda: None
    replaced = [(torch.cuda, n) for n in ("set_device", "synchronize", "reset_peak_memory_stats")] + \
        [(torch.cuda.nvtx, n) for n in ("range_push", "range_pop", "mark", "range_start", "range_end")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in replaced]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    real = torch.cuda.set_device

    def set_device(device) -> None:
        index = device.index if isinstance(device, torch.device) else device
        if isinstance(index, int) and 0 <= index < ranks:
            return
        real(device)  # outside the ranks' indices: torch's own error

    def nothing(*args, **kwargs) -> None:
        return None

    def depth(*args, **kwargs) -> int:
        return 0  # torch's range_push/range_pop return the nesting depth

    torch.cuda.set_device = set_device
    torch.cuda.synchronize = nothing
    torch.cuda.reset_peak_memory_stats = nothing
    for name in ("range_push", "range_pop"):
        setattr(torch.cuda.nvtx, name, depth)
    for name in ("mark", "range_start", "range_end"):
        setattr(torch.cuda.nvtx, name, nothing)

    def restore() -> None:
        for owner, name, value in saved:
            setattr(owner, name, value)

    return restore


def device_count_hint(error: BaseException) -> str | None:
    """What to do when a script's ``ZeroDivisionError`` came from dividing by
    ``torch.cuda.device_count()`` on a machine without CUDA (``rank % torch.cuda.device_count()``),
    naming its line; None for any other error."""
    import traceback

    import torch

    if not isinstance(error, ZeroDivisionError) or torch.cuda.is_available():
        return None
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.line and "device_count" in frame.line:
            return (f"{frame.filename}:{frame.lineno}: `{frame.line.strip()}` divides by torch.cuda.device_count(), "
                    "which is 0 on a machine without CUDA; run the script on GPUs, or take the rank's device "
                    "index from the LOCAL_RANK environment variable (smp.local_rank()), which this launcher "
                    "sets on CPU too")
    return None
