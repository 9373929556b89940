"""What every benchmark shares: starting ranks, one thread each, honest peak memory, the machine's
load, and where results go.

Ranks start one of two ways, both on CPU and gloo with one thread per rank (``OMP_NUM_THREADS=1``
before torch is imported, and ``torch.set_num_threads(1)``; ``MODELPARALLEL_DEVICE=cpu`` and no
visible GPU, also on a GPU machine):

- ``spawn(fn, nproc, *args)``: ``torch.multiprocessing`` processes with the environment torchrun
  would set (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...), so
  ``smp.init()`` joins them as it joins a torchrun job. ``fn`` must be a module-level function;
  each rank's return value (JSON-serializable, or None) comes back in a list indexed by rank.
- ``torchrun(script, nproc, argv)``: the real launcher on ``script argv``; each rank hands its
  record back with ``report(record)``. ``start`` / ``finish`` do the same in two halves, so jobs
  can run side by side, and ``start(source=checkout(ref))`` runs an older revision's package.

Peak memory: safetensors weights are memory-mapped, so a freshly loaded model's resident size
hides them until they are read. ``peak_above_baseline_mb`` touches every local tensor in place,
then reads ``VmHWM`` and subtracts the resident size taken by ``baseline_mb()`` right after the
imports (the interpreter, torch and transformers are not the model's cost).

Results go to ``bench/results/<name>.json`` (or ``$BENCH_RESULTS_DIR``, for trial runs that must not
replace the recorded results), with the machine and its load averages: with one thread per rank
on a small machine any other process takes time straight out of a rank.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS_DIR") or _ROOT / "bench" / "results")
_RANK_DIR = "BENCH_RANK_RECORDS"  # where ``report`` writes, set by ``torchrun``
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false",
               # CPU benchmarks stay on CPU and gloo on a machine with GPUs (bench_gpu.py is the GPU one)
               "MODELPARALLEL_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}


# ---- starting ranks -------------------------------------------------------------------------------

def one_thread() -> None:
    """Pin this process's torch to one thread (the launchers also set the environment)."""
    import torch

    torch.set_num_threads(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable, nproc: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc), **_ONE_THREAD)
    one_thread()
    record = fn(*args)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn: Callable, nproc: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` fresh processes forming one gloo job; returns each rank's
    return value, indexed by rank.

    Raises:
        torch.multiprocessing.ProcessRaisedException: naming the rank whose ``fn`` raised.
    """
    import torch.multiprocessing as mp

    saved = {k: os.environ.get(k) for k in _ONE_THREAD}
    os.environ.update(_ONE_THREAD)  # children import torch with it already set
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ranks-") as out:
            mp.start_processes(_rank_main, args=(fn, nproc, _free_port(), out, args), nprocs=nproc,
                               start_method="spawn")
            return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Launch:
    """A torchrun job started by ``start``: its process and the directory its ranks report to."""

    def __init__(self, proc: subprocess.Popen, out: tempfile.TemporaryDirectory, nproc: int):
        self.proc, self.out, self.nproc = proc, out, nproc


def start(script: str | Path, nproc: int, argv: Sequence[str] = (), source: str = "",
          capture: bool = True) -> Launch:
    """Start ``script argv`` under torchrun on ``nproc`` local ranks, one thread each, without
    waiting (two jobs side by side measure how much they slow each other).

    Args:
        source: a checkout whose ``modelparallel`` the ranks import instead of this one (``checkout``).
        capture: keep the job's output (printed only if it fails) instead of passing it through.
    """
    out = tempfile.TemporaryDirectory(prefix="bench-ranks-")
    env = {**os.environ, **_ONE_THREAD, _RANK_DIR: out.name, **({"PYTHONPATH": source} if source else {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(script).resolve()), *argv]
    pipe = subprocess.PIPE if capture else None
    return Launch(subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True), out, nproc)


def finish(launch: Launch) -> list[Any]:
    """Wait for a ``start``ed job; what each rank passed to ``report`` (None if it did not), by rank.

    Raises:
        subprocess.CalledProcessError: if a rank failed (a captured job's output tail is printed first).
    """
    stdout, stderr = launch.proc.communicate()
    try:
        if launch.proc.returncode:
            if stdout or stderr:
                print(f"{(stdout or '')[-2000:]}\n{(stderr or '')[-4000:]}", file=sys.stderr)
            raise subprocess.CalledProcessError(launch.proc.returncode, launch.proc.args)
        files = [Path(launch.out.name, f"rank{r}.json") for r in range(launch.nproc)]
        return [json.loads(f.read_text()) if f.is_file() else None for f in files]
    finally:
        launch.out.cleanup()


def torchrun(script: str | Path, nproc: int, argv: Sequence[str] = ()) -> list[Any]:
    """Run ``script argv`` under torchrun on ``nproc`` local ranks, one thread each; returns what
    each rank passed to ``report`` (None for a rank that did not), indexed by rank.

    Raises:
        subprocess.CalledProcessError: if a rank failed (its output went to the terminal).
    """
    return finish(start(script, nproc, argv, capture=False))


def checkout(ref: str) -> str:
    """A detached ``git worktree`` of revision ``ref`` (a "before" package for ``start(source=)``)."""
    dest = Path(tempfile.mkdtemp(prefix="bench-baseline-")) / "src"
    subprocess.run(["git", "-C", str(_ROOT), "worktree", "add", "--detach", str(dest), ref], check=True,
                   capture_output=True)
    return str(dest)


def drop_checkout(path: str) -> None:
    """Remove a ``checkout``."""
    subprocess.run(["git", "-C", str(_ROOT), "worktree", "remove", "--force", path], capture_output=True)


def report(record: Any) -> None:
    """Hand this rank's record (JSON-serializable) back to ``torchrun``'s caller."""
    rank = int(os.environ.get("RANK", 0))
    Path(os.environ[_RANK_DIR], f"rank{rank}.json").write_text(json.dumps(record))


def slowest(seconds: Sequence[float]) -> list[float]:
    """Per entry, the largest value over all ranks (a collective): a step ends when its slowest
    rank ends."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(seconds), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---- memory --------------------------------------------------------------------------------------

def status_mb(field: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(f"{field} not in /proc/self/status")


def baseline_mb() -> float:
    """The resident size now: call it right after the imports, before building anything."""
    return status_mb("VmRSS")


def touch(*modules) -> None:
    """An in-place no-op on every local floating-point parameter and buffer shard (a read of the
    others), so memory-mapped weights become resident and count in ``VmHWM``."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                local = t.to_local() if isinstance(t, DTensor) else t
                if local.is_floating_point():
                    local.mul_(1)
                else:
                    local.sum()


def peak_above_baseline_mb(baseline: float, *modules) -> float:
    """Peak resident size (``VmHWM``) above ``baseline``, after touching ``modules``' tensors."""
    touch(*modules)
    return status_mb("VmHWM") - baseline


def reset_peak() -> float:
    """Return freed memory to the system and restart ``VmHWM`` from the current resident size
    (to measure one phase's peak); returns that size in MiB."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory kept by malloc would hide growth
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mb("VmRSS")


# ---- machine and results -------------------------------------------------------------------------

def evict(directory: str | Path) -> None:
    """Drop a directory's files from the page cache (they must be clean: written and fsynced), so
    the next load reads the disk, as a job resuming after a restart does."""
    for f in Path(directory).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def cache(directory: str | Path) -> None:
    """Read a directory's files once, so the next load reads the page cache. Both sides of a
    warm comparison need it: a saver that drops what it wrote from the cache (ours does, to
    keep the job's memory) would otherwise be timed from disk against one read from memory."""
    for f in Path(directory).rglob("*"):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(1 << 24):
                    pass


def smp_step_times(model, optimizer, batch, steps: int, warmup: int) -> dict[str, Any]:
    """Time ``steps`` training steps (after ``warmup``) of a ``DistributedModel`` through
    ``@smp.step`` on ``batch`` (its own labels), each with ``optimizer``'s step: every step's time
    on the slowest rank (a collective), and the load average."""
    import time

    import modelparallel as smp

    @smp.step
    def train_step(x):
        loss = model(x, labels=x).loss
        model.backward(loss)
        return loss

    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        train_step(batch)
        optimizer.step()
        optimizer.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {"times": slowest(times), "load": load_average()}


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages (above the core count: the cores were shared)."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """CPU, cores, library versions and the load averages now."""
    import torch
    import transformers

    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), None) if cpuinfo.exists() else None
    return {"cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "load_average": load_average()}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Min, median and max of one quantity measured in several repeats (and the values): on a
    shared virtual machine a ratio varies from run to run, so a single run is not a result."""
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "values": values}


def write_result(name: str, result: dict[str, Any], out: Path | None = None) -> Path:
    """Write ``result`` with the machine (and the load averages at the end) to
    ``RESULTS_DIR/<name>.json`` (or ``out``); returns the path."""
    path = out or RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "machine": machine()}, indent=1) + "\n")
    print(f"wrote {path} (load average {load_average()} on {os.cpu_count()} cores)")
    return path
