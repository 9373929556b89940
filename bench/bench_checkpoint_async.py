"""Asynchronous checkpoints against synchronous ones and DCP, and saves against the disk's limit.

Two ranks (TP=2, one thread each) hold a GPT-2 with AdamW state (``bench_checkpoint``'s presets;
``medium`` is gpt2-medium's shape, about 4.3 GB per checkpoint). In one run, per repeat:

* ``disk``: each rank writes as many bytes as it saves, in 64 MiB writes, then fsyncs; the total
  over the slowest rank's time is the disk's write limit for this pattern (two writers);
* ``sync``: ``smp.save_checkpoint(partial=True)`` (fsync, checksums, commit); MB/s and its ratio
  to the disk limit;
* ``dcp``: ``torch.distributed.checkpoint.save`` of the same state, fsynced as DCP does;
* ``async``: ``save_checkpoint(..., async_save=True)``: the time training is blocked (the call),
  then training steps while the background write runs (their time against steps without a save:
  the slowdown), then ``wait_for_checkpoints`` (the time to commit after the call);
* the staging bytes of the asynchronous saver and the peak RSS above the process's RSS before
  the saves (VmHWM reset through ``/proc/self/clear_refs``).

Times are the slowest rank's, medians over the repeats after a warm-up. Usage:
``python bench/bench_checkpoint_async.py [--preset medium|small|tiny] [--repeats 3]``; writes
``bench/results/checkpoint_async.json`` with the load average. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_checkpoint as base  # noqa: E402
import common  # noqa: E402

WRITE_BLOCK = 64 << 20


def _disk(work: Path, nbytes: int) -> float:
    """Seconds for this rank to write and fsync ``nbytes`` (slowest rank)."""
    block = bytearray(os.urandom(1 << 20)) * (WRITE_BLOCK >> 20)
    import torch.distributed as dist

    path = work / f"disk{dist.get_rank()}.bin"

    def write():
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(block[:min(left, len(block))])
            f.flush()
            os.fsync(f.fileno())

    seconds = base._timed(write)
    path.unlink()
    return seconds


def _step(model, optimizer) -> None:
    import torch

    ids = torch.arange(64).reshape(2, 32) % model.module.config.vocab_size
    model.backward(model(ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()


def _async_round(model, optimizer, work: Path, tag: str, steps: int) -> dict:
    import modelparallel as smp

    blocked = base._timed(lambda: smp.save_checkpoint(work / "async", tag, async_save=True,
                                                      num_kept_partial_checkpoints=1))
    start = time.perf_counter()
    during = []
    for _ in range(steps):
        t = time.perf_counter()
        _step(model, optimizer)
        during.append(time.perf_counter() - t)
    smp.wait_for_checkpoints()
    committed = common.slowest([time.perf_counter() - start])[0] + blocked
    return {"blocked_s": blocked, "committed_s": committed, "step_s_during": statistics.median(during)}


def worker(args) -> None:
    import torch.distributed as dist

    import modelparallel as smp

    common.one_thread()
    model, optimizer = base._build(args.preset)
    work = Path(args.work)
    quiet = [base._timed(lambda: _step(model, optimizer)) for _ in range(3)]
    rows: dict[str, list] = {"disk": [], "sync": [], "dcp": [], "async": []}
    rss_base = common.reset_peak()
    for r in range(-1, args.repeats):
        rows["sync"].append(base._timed(lambda: smp.save_checkpoint(work / "sync", f"r{r}",
                                                                    num_kept_partial_checkpoints=1)))
        size = base._dir_bytes(work / "sync" / f"r{r}_partial")
        rows["disk"].append(_disk(work, size // dist.get_world_size()))
        rows["dcp"].append(base._timed(lambda: base._dcp_save(model, optimizer, work / f"dcp{r}")))
        if smp.rank() == 0:
            shutil.rmtree(work / f"dcp{r}")
        rows["async"].append(_async_round(model, optimizer, work, f"r{r}", args.steps))
        if r < 0:
            rows = {k: [] for k in rows}
    peak = common.slowest([(common.status_mb("VmHWM") - rss_base) * 2**20])[0]
    med = {k: statistics.median(v) for k, v in rows.items() if k != "async"}
    asy = {k: statistics.median(x[k] for x in rows["async"]) for k in rows["async"][0]}
    result = {"preset": args.preset, "checkpoint_bytes": size, "steps_during_async": args.steps,
              "seconds": rows, "disk_mb_s": size / 1e6 / med["disk"], "sync_mb_s": size / 1e6 / med["sync"],
              "dcp_mb_s": size / 1e6 / med["dcp"], "sync_vs_disk": med["disk"] / med["sync"],
              "async_blocked_s": asy["blocked_s"], "async_blocked_vs_sync": asy["blocked_s"] / med["sync"],
              "async_committed_s": asy["committed_s"], "step_s_quiet": statistics.median(quiet),
              "step_s_during_async": asy["step_s_during"],
              "step_slowdown_during_async": asy["step_s_during"] / statistics.median(quiet),
              "staging_bytes": smp.checkpoint_staging_bytes(), "peak_rss_above_baseline_bytes": peak}
    if smp.rank() == 0:
        common.report(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(base.PRESETS), default="medium")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="training steps run while each async save is written")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "checkpoint_async.json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-async-", dir=args.dir))
    try:
        argv = ["--worker", "--work", str(work), "--preset", args.preset, "--repeats", str(args.repeats),
                "--steps", str(args.steps)]
        result = common.torchrun(__file__, 2, argv)[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_average_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{result['preset']}: {result['checkpoint_bytes'] / 1e9:.2f} GB per checkpoint; disk {result['disk_mb_s']:.0f} "
          f"MB/s; sync save {result['sync_mb_s']:.0f} MB/s ({result['sync_vs_disk']:.2f}x the disk), DCP "
          f"{result['dcp_mb_s']:.0f} MB/s; async: blocked {result['async_blocked_s']:.2f} s "
          f"({100 * result['async_blocked_vs_sync']:.1f}% of a sync save), committed after "
          f"{result['async_committed_s']:.2f} s, steps {result['step_slowdown_during_async']:.2f}x slower meanwhile; "
          f"staging {result['staging_bytes'] / 1e6:.0f} MB; load average {result['load_average_after']:.1f}")


if __name__ == "__main__":
    main()
