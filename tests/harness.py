"""Multi-rank test harness: long-lived gloo ranks that run module-level check functions.

Starting a rank costs seconds (importing torch and transformers), so the ranks are forks of one
fork server that imported them once (``PRELOAD``), and each world size gets one pool of processes
kept alive for the whole session; a test sends a function reference and its
arguments to every rank and gets every rank's return value back. An exception on any rank fails
the test with that rank's traceback; a rank that hangs (its peers died mid-collective) makes the
pool be torn down and respawned for the next test, so one failure never hangs the suite.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from multiprocessing.reduction import ForkingPickler

RESULT_TIMEOUT_S = 300
AFTER_ERROR_WAIT_S = 15


def _worker(rank: int, world: int, store_path: str, tasks, results) -> None:
    env = _rank_env()  # already the fork server's; set again for what reads it later
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    threads = env["OMP_NUM_THREADS"]
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(threads))
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            ForkingPickler.dumps(value)  # fail here, visibly, rather than in the queue's feeder thread
            results.put((rank, "ok", value))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, "error", traceback.format_exc()))


PRELOAD = ("torch", "torch.distributed.tensor", "transformers", "transformers.modeling_utils",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama", "modelparallel",
           "modelparallel.model", "modelparallel.parallelize", "modelparallel.optimizer", "modelparallel.checkpoint.api")
"""Imported once by the fork server that starts every pool's ranks (a rank's seconds of start-up are
these imports): a rank is a fork of that server, with nothing but the imports done (no thread, no
OpenMP pool, no process group, no CUDA), then sets its environment and joins its own group as a
spawned rank would."""


def _rank_env() -> dict[str, str]:
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # one per rank unless the run asks for more
    # gloo ranks on CPU also on a machine with GPUs (rank r would take cuda:r, which a one-GPU
    # machine lacks; NCCL refuses two ranks on one GPU)
    return dict(OMP_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                CUDA_VISIBLE_DEVICES="", MODELPARALLEL_DEVICE="cpu")


def _context():
    """A fork server's context that has imported ``PRELOAD`` (started once, at the first pool), in
    the ranks' environment: torch and OpenMP read it when they load, there."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    saved = dict(os.environ)
    os.environ.update(_rank_env())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx


class RankPool:
    """``world`` live ranks; ``run(fn, ...)`` calls ``fn`` on all of them and returns their results."""

    def __init__(self, world: int):
        self.world = world
        ctx = _context()
        fd, self.store_path = tempfile.mkstemp(prefix="mp-store-")
        os.close(fd)
        os.unlink(self.store_path)
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, self.store_path, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, **kwargs) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world, []
        pending = set(range(self.world))
        while pending:
            wait = AFTER_ERROR_WAIT_S if errors else RESULT_TIMEOUT_S
            try:
                rank, status, value = self.results.get(timeout=wait)
            except queue.Empty:
                self.broken = True
                errors.append(f"ranks {sorted(pending)} did not finish within {wait}s")
                break
            pending.discard(rank)
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            if pending:
                self.broken = True
            raise AssertionError(f"{fn.__name__} failed on {self.world} ranks:\n" + "\n".join(errors))
        return out

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive() and not self.broken:
                q.put(None)
        for p in self.procs:
            p.join(timeout=5 if not self.broken else 0.1)
            if p.is_alive():
                p.kill()


def thread_count() -> int:
    """This process's threads (its ``/proc/self/task`` entries) once threads that have just
    finished are gone: a joined thread can stay listed for a moment while it exits, so the
    lowest of a few reads is taken (a count that still includes it would look like a leak)."""
    counts = []
    for _ in range(20):
        counts.append(len(os.listdir("/proc/self/task")))
        if len(counts) >= 3 and counts[-1] == counts[-2] == counts[-3]:
            break
        time.sleep(0.05)
    return min(counts)


_POOLS: dict[int, RankPool] = {}


def pool(world: int) -> RankPool:
    """The session's pool of ``world`` ranks, respawned if a previous test broke it."""
    p = _POOLS.get(world)
    if p is None or p.broken:
        if p is not None:
            p.close()
        p = _POOLS[world] = RankPool(world)
    return p


def run(world: int, fn, *args, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world`` ranks; return the per-rank results."""
    p = pool(world)
    try:
        return p.run(fn, *args, **kwargs)
    finally:
        if p.broken:
            p.close()


@atexit.register
def _close_all() -> None:
    for p in _POOLS.values():
        p.close()
