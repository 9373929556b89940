"""Which device a rank computes on, and where the small tensors of a collective must live.

A rank runs on CUDA whenever PyTorch sees a GPU (``cuda:LOCAL_RANK``, NCCL), else on CPU (gloo).
``MODELPARALLEL_DEVICE=cpu`` keeps a job on CPU and gloo on a machine with GPUs (tests, a quick
run beside a busy GPU); ``MODELPARALLEL_DEVICE=cuda`` makes a machine without a visible GPU an
error instead of a silent CPU run. The launchers check the ranks per machine against the GPUs
before any rank starts (``launch_problems``): NCCL refuses two ranks on one GPU, and a rank whose
``LOCAL_RANK`` has no GPU fails with CUDA's "invalid device ordinal" deep inside start-up.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

DEVICE_ENV = "MODELPARALLEL_DEVICE"
CHOICES = ("cpu", "cuda")


def requested() -> str | None:
    """``MODELPARALLEL_DEVICE`` ("cpu" or "cuda"), or None when unset or empty (automatic).

    Raises:
        ValueError: for any other value, naming the variable.
    """
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if value and value not in CHOICES:
        raise ValueError(f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r}: use one of {', '.join(CHOICES)} (or leave it unset "
                         "to use the GPUs when PyTorch sees any)")
    return value or None


def gpu_count() -> int:
    """GPUs this job may use: 0 under ``MODELPARALLEL_DEVICE=cpu`` or without CUDA."""
    if requested() == "cpu" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def device_type() -> str:
    """"cuda" or "cpu": what ``rank_device`` gives this process.

    Raises:
        RuntimeError: under ``MODELPARALLEL_DEVICE=cuda`` when PyTorch sees no GPU.
    """
    want = requested()
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_ENV}=cuda but PyTorch sees no GPU (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}, torch {torch.__version__})")
    return "cuda" if want != "cpu" and torch.cuda.is_available() else "cpu"


def rank_device(local_rank: int) -> torch.device:
    """This rank's device: ``cuda:local_rank`` (made current) or the CPU.

    Raises:
        RuntimeError: when ``local_rank`` has no GPU (more ranks on this machine than GPUs).
    """
    if device_type() == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"local rank {local_rank} has no GPU: this machine shows {count} GPU(s) and each rank needs "
                           f"its own; start at most {count} rank(s) per machine, or set {DEVICE_ENV}=cpu to run on CPU")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend() -> str:
    """The process-group backend for ``device_type()``."""
    return "nccl" if device_type() == "cuda" else "gloo"


def for_group(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective over ``group`` (default: the world) must live: NCCL only
    reduces CUDA tensors, gloo reduces CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch_problems(ranks_per_machine: int, fix: str) -> list[str]:
    """A one-line problem when this machine has GPUs but fewer than ``ranks_per_machine`` (each
    rank needs its own GPU), else none. ``fix`` names the option that sets the ranks per machine.
    A ``MODELPARALLEL_DEVICE`` that cannot be honoured (a bad value, cuda without a GPU) is the
    problem instead."""
    try:
        device_type()
        gpus = gpu_count()
    except (ValueError, RuntimeError) as exc:
        return [str(exc)]
    if gpus == 0 or ranks_per_machine <= gpus:
        return []
    return [f"{ranks_per_machine} ranks per machine but PyTorch sees {gpus} GPU(s), and each rank needs its own: "
            f"{fix}, or run on CPU with {DEVICE_ENV}=cpu (or CUDA_VISIBLE_DEVICES=\"\")"]
