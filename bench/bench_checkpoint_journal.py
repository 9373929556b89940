"""Resume cost of the two all-or-nothing modes: staged in memory vs through the undo journal.

A GPT-2 (preset shapes as in bench_checkpoint.py) with AdamW state that has stepped, at TP=2 on
two ranks (one thread each), saved once; then, alternating the order per repeat, a resume into
the live (trained) model and optimizer with ``staging="memory"`` and with ``staging="journal"``
(bucket ``--bucket-mb``, journal in ``$TMPDIR``). Per resume: its time (slowest rank, files warm
in the page cache, ``os.sync`` first so earlier write-back does not land in the timing), the peak
RSS above the RSS just before it (``common.reset_peak``; glibc's allocator as it is by default,
or with its mmap threshold fixed: ``--fixed-mmap-threshold``),
and what the library reports (``Cost``: bytes staged, bucket peak, bytes journaled).

Expected: memory mode's peak is about the rank's model and optimizer state once more; journal
mode's about one bucket (plus what glibc keeps of freed buckets); the journal's time cost is one
write of the same bytes to local disk (FACTS.md: about 1 GB/s with fsync; no fsync here).

Usage: ``python bench/bench_checkpoint_journal.py [--preset small|tiny] [--repeats 3] [--bucket-mb 64]``;
writes ``bench/results/checkpoint_journal.json``. Run it on a quiet machine: the load average
after the run is recorded.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common
from bench_checkpoint import PRESETS, _build


def _resume(path: Path, mode: str, bucket: int) -> dict:
    import os

    import torch.distributed as dist

    import modelparallel as smp
    from modelparallel import runtime

    os.sync()
    dist.barrier()
    before = common.reset_peak()
    start = time.perf_counter()
    smp.resume_from_checkpoint(path, "a", staging=mode, staging_bucket=bucket)
    seconds = common.slowest([time.perf_counter() - start])[0]
    peak = common.status_mb("VmHWM") - before
    costs = runtime.current().resume.costs
    held = [c.in_memory for c in costs.values()]  # staged parts are held together; buckets one part at a time
    return {"seconds": seconds, "peak_mb": peak, "cost": {k: str(c) for k, c in costs.items()},
            "in_memory_mb": (sum(held) if mode == "memory" else max(held)) / 2**20,
            "journaled_mb": sum(c.journaled for c in costs.values()) / 2**20}


def run(preset: str, repeats: int, bucket_mb: int, work: str, fixed_mmap: bool) -> dict:
    import ctypes

    import modelparallel as smp

    common.one_thread()
    if fixed_mmap:  # M_MMAP_THRESHOLD: freed buckets go back to the system instead of glibc's heap
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    model, optimizer = _build(preset)
    path = Path(work)
    smp.save_checkpoint(path, "a")
    rows = {"memory": [], "journal": []}
    for r in range(-1, repeats):  # round -1 warms up, not counted
        for mode in (("memory", "journal") if r % 2 == 0 else ("journal", "memory")):
            row = _resume(path, mode, bucket_mb << 20)
            if r >= 0:
                rows[mode].append(row)
    return {"rank": smp.rank(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--fixed-mmap-threshold", action="store_true",
                        help="fix glibc's mmap threshold at 64 KiB in the ranks (else adaptive, the default)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-journal-")
    try:
        ranks = common.spawn(run, 2, args.preset, args.repeats, args.bucket_mb, work, args.fixed_mmap_threshold)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for mode in ("memory", "journal"):
        rows = [row for rank in ranks for row in rank["rows"][mode]]
        summary[mode] = {"median_seconds": statistics.median(r["seconds"] for r in rows),
                         "max_peak_mb": max(r["peak_mb"] for r in rows),
                         "in_memory_mb_per_rank": max(r["in_memory_mb"] for r in rows),
                         "journaled_mb_per_rank": max(r["journaled_mb"] for r in rows)}
    summary["journal_time_ratio"] = summary["journal"]["median_seconds"] / summary["memory"]["median_seconds"]
    name = "checkpoint_journal" + ("_fixed_mmap" if args.fixed_mmap_threshold else "")
    common.write_result(name, {"preset": args.preset, "bucket_mb": args.bucket_mb, "repeats": args.repeats,
                               "fixed_mmap_threshold": args.fixed_mmap_threshold, "summary": summary,
                               "ranks": ranks})
    print(summary)


if __name__ == "__main__":
    sys.exit(main())
