"""A synchronous partial save against the disk's write limit and DCP, in one run.

Two ranks (TP=2, one thread each) hold a GPT-2 with AdamW state (``bench_checkpoint``'s presets;
``medium`` is gpt2-medium's shape, about 4.3 GB per checkpoint). Per repeat, in an order that
rotates so no method always follows another:

* ``disk``: each rank writes as many bytes as this rank's part of the checkpoint, in 64 MiB
  writes from memory, then fsyncs; three times: plain, starting write-back every 32 MiB
  (``sync_file_range``), and the same with each range waited for and dropped from the page
  cache one range later (drop-behind); ``--sweep`` adds write-back every 8 and 128 MiB, and two
  files per rank written by two threads. The fastest is the disk's limit for that repeat: the
  best a writer of these bytes does on this disk, whatever the pattern (the save's writer uses
  drop-behind every 32 MiB, one file per rank and part, from this measurement);
* ``tensors``: each rank writes the very tensors its save writes (captured from the planner at a
  warm-up save), straight from their memory with the save's write-back, then fsyncs: what a
  writer of these bytes without any format would take (``sync_vs_tensors``); the ``disk``
  pattern's source is one 64 MiB block, mapped and warm, where a save reads gigabytes;
* ``sync``: ``smp.save_checkpoint(partial=True)`` (serialization, checksums, fsync, commit);
* ``dcp``: ``torch.distributed.checkpoint.save`` of the same state, fsynced as DCP does;
* ``retention``: deleting a checkpoint, which a save with ``num_kept_partial_checkpoints`` does
  after its commit (timed apart: DCP deletes nothing, the disk measure neither). Each method's
  files are deleted right after it, so all of them write into the same page-cache state.

Every timing starts with nothing left for the disk to write (``os.sync``) and is the slowest
rank's. Reported: per method the min/median/max seconds and MB/s; ``sync_vs_disk`` is the disk's
median time over the save's median time (1.0: the save writes at the disk's speed), also per
repeat. A virtual disk's speed varies between repeats: hence the repeats and the spread.
Usage: ``python bench/bench_checkpoint_disk.py [--preset medium|small|tiny] [--repeats 5]``;
writes ``bench/results/checkpoint_disk.json`` with the load average before and after.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_checkpoint as base  # noqa: E402
import common  # noqa: E402

BLOCK = 64 << 20
WRITEBACK = 32 << 20


class _Pacer:
    """Write-back as a writer of one file paces it: none, started every ``every`` bytes, or
    started and then waited for and dropped from the page cache one range later (``drop``: the
    save's policy, ``modelparallel/checkpoint/save/stream.py``)."""

    def __init__(self, fd: int, every: int | None, drop: bool = False):
        self.fd, self.every, self.drop = fd, every, drop
        self.sync_range = ctypes.CDLL(None, use_errno=True).sync_file_range
        self.synced = self.dropped = 0

    def wrote(self, done: int) -> None:
        if self.every is None or done - self.synced < self.every:
            return
        if self.drop and self.synced > self.dropped:
            self.sync_range(self.fd, ctypes.c_int64(self.dropped), ctypes.c_int64(self.synced - self.dropped), 7)
            os.posix_fadvise(self.fd, self.dropped, self.synced - self.dropped, os.POSIX_FADV_DONTNEED)
            self.dropped = self.synced
        self.sync_range(self.fd, ctypes.c_int64(self.synced), ctypes.c_int64(done - self.synced), 2)
        self.synced = done


def _disk(work: Path, nbytes: int, writeback: int | None, files: int = 1, drop: bool = False) -> float:
    """Seconds for every rank to write and fsync ``nbytes`` (slowest rank), split over ``files``
    files written by as many threads, starting write-back every ``writeback`` bytes (None: never),
    with ``drop``: each range waited for and dropped from the page cache one range later."""
    import threading

    import torch.distributed as dist

    block = memoryview(bytearray(os.urandom(1 << 20)) * (BLOCK >> 20))
    paths = [work / f"disk{dist.get_rank()}_{i}.bin" for i in range(files)]

    def write_one(path: Path, n: int):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done, pacer = 0, _Pacer(fd, writeback, drop)
            while done < n:
                done += os.write(fd, block[:min(n - done, BLOCK)])
                pacer.wrote(done)
            os.fsync(fd)
        finally:
            os.close(fd)

    def write():
        threads = [threading.Thread(target=write_one, args=(path, nbytes // files)) for path in paths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    seconds = base._timed(write)
    for path in paths:
        path.unlink()
    return seconds


def _resolved_tensors(save) -> list:
    """The tensors ``save()`` writes on this rank (what its planner resolves: the rank's own
    shards after the dedup, made contiguous), kept by reference."""
    from modelparallel.checkpoint.save.planner import ContiguousSavePlanner

    seen, original = [], ContiguousSavePlanner.resolve_data

    def resolve(self, item):
        data = original(self, item)
        if hasattr(data, "untyped_storage"):
            seen.append(data)
        return data

    ContiguousSavePlanner.resolve_data = resolve
    try:
        save()
    finally:
        ContiguousSavePlanner.resolve_data = original
    return seen


def _disk_tensors(work: Path, tensors: list) -> float:
    """Seconds for every rank to write the bytes of its own ``tensors`` straight from their memory
    (no serialization: one write per tensor, 64 MiB at most), with the save's write-back (started
    every 32 MiB, dropped behind), then fsync: the speed limit of a writer of these tensors, where
    ``_disk`` writes one 64 MiB block over and over (its source stays mapped and warm)."""
    import torch
    import torch.distributed as dist

    path = work / f"tensors{dist.get_rank()}.bin"

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done, pacer = 0, _Pacer(fd, WRITEBACK, drop=True)
            for t in tensors:
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                for i in range(0, len(view), BLOCK):
                    done += os.write(fd, view[i:i + BLOCK])
                    pacer.wrote(done)
            os.fsync(fd)
        finally:
            os.close(fd)

    seconds = base._timed(write)
    path.unlink()
    return seconds


SWEEP = {"disk_writeback_8mib": dict(writeback=8 << 20), "disk_writeback_128mib": dict(writeback=128 << 20),
         "disk_writeback_2files": dict(writeback=WRITEBACK, files=2)}
"""Other write patterns ``--sweep`` adds: the write-back interval and the number of files (threads)
per rank the save's writer could use."""


def _methods(model, optimizer, work: Path, r: int, nbytes: int, sweep: bool, tensors: list) -> dict:
    import modelparallel as smp

    def sync():
        return base._timed(lambda: smp.save_checkpoint(work / "sync", f"r{r}"))

    def dcp():
        t = base._timed(lambda: base._dcp_save(model, optimizer, work / f"dcp{r}"))
        if smp.rank() == 0:
            shutil.rmtree(work / f"dcp{r}")
        return t

    runs = {"sync": sync, "dcp": dcp, "disk_plain": lambda: _disk(work, nbytes, None),
            "disk_writeback": lambda: _disk(work, nbytes, WRITEBACK),
            "disk_dropbehind": lambda: _disk(work, nbytes, WRITEBACK, drop=True),
            "tensors": lambda: _disk_tensors(work, tensors)}
    if sweep:
        runs.update({name: (lambda kw=kw: _disk(work, nbytes, **kw)) for name, kw in SWEEP.items()})
    names = list(runs)
    shift = r % len(names)
    return {name: runs[name]() for name in names[shift:] + names[:shift]}


def _retention(work: Path, r: int) -> float:
    """Seconds to delete this repeat's checkpoint (rank 0 deletes, as a save's retention does).
    Deleted at once, as the disk measure and DCP's files are: every method then writes while the
    page cache holds the same (a VM's first touch of memory the page cache never used is slow)."""
    import modelparallel as smp

    def delete():
        if smp.rank() == 0:
            shutil.rmtree(work / "sync" / f"r{r}_partial")
    return base._timed(delete)


def _spread(values: list[float], nbytes: int) -> dict:
    return {"seconds": values, "min_s": min(values), "median_s": statistics.median(values), "max_s": max(values),
            "median_mb_s": nbytes / 1e6 / statistics.median(values)}


def worker(args) -> None:
    import torch.distributed as dist

    import modelparallel as smp

    common.one_thread()
    model, optimizer = base._build(args.preset)
    work = Path(args.work)
    # first-touch costs (page cache, planner) out of the timings; what it writes is kept for "tensors"
    tensors = _resolved_tensors(lambda: smp.save_checkpoint(work / "sync", "warm"))
    nbytes = base._dir_bytes(work / "sync" / "warm_partial")
    shutil.rmtree(work / "sync" / "warm_partial") if smp.rank() == 0 else None
    rows: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for name, seconds in _methods(model, optimizer, work, r, nbytes // dist.get_world_size(), args.sweep,
                                       tensors).items():
            rows.setdefault(name, []).append(seconds)
        rows.setdefault("retention", [])
        rows["retention"].append(_retention(work, r))
        if smp.rank() == 0:
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in rows.items()),
                  file=sys.stderr, flush=True)
    rows["disk"] = [min(times) for times in zip(*(v for k, v in rows.items() if k.startswith("disk_")))]
    result = {"preset": args.preset, "checkpoint_bytes": nbytes, "repeats": args.repeats,
              **{k: _spread(v, nbytes) for k, v in rows.items()},
              "sync_vs_disk": statistics.median(rows["disk"]) / statistics.median(rows["sync"]),
              "sync_vs_disk_per_repeat": [d / s for d, s in zip(rows["disk"], rows["sync"])],
              "sync_vs_dcp": statistics.median(rows["dcp"]) / statistics.median(rows["sync"]),
              "tensor_bytes_per_rank": common.slowest([sum(t.numel() * t.element_size() for t in tensors)])[0],
              "sync_vs_tensors": statistics.median(rows["tensors"]) / statistics.median(rows["sync"]),
              "sync_vs_tensors_per_repeat": [t / s for t, s in zip(rows["tensors"], rows["sync"])]}
    if smp.rank() == 0:
        common.report(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(base.PRESETS), default="medium")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also other write-back intervals and two files per rank")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "checkpoint_disk.json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()[0]
    result = base.run_in_scratch(__file__, args.dir, "bench-ckpt-disk-", ["--preset", args.preset, "--repeats",
                                 str(args.repeats)] + (["--sweep"] if args.sweep else []))
    result.update(load_average_before=load_before, load_average_after=os.getloadavg()[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    s, d, c = result["sync"], result["disk"], result["dcp"]
    print(f"{result['preset']}: {result['checkpoint_bytes'] / 1e9:.2f} GB; disk {d['median_mb_s']:.0f} MB/s "
          f"({d['min_s']:.2f}-{d['max_s']:.2f} s); sync save {s['median_mb_s']:.0f} MB/s ({s['min_s']:.2f}-"
          f"{s['max_s']:.2f} s) = {result['sync_vs_disk']:.2f}x the disk (per repeat "
          f"{min(result['sync_vs_disk_per_repeat']):.2f}-{max(result['sync_vs_disk_per_repeat']):.2f}); DCP "
          f"{c['median_mb_s']:.0f} MB/s; the same tensors written raw {result['tensors']['median_mb_s']:.0f} MB/s "
          f"(save = {result['sync_vs_tensors']:.2f}x of it); retention {result['retention']['median_s']:.2f} s; "
          f"load average "
          f"{result['load_average_before']:.1f} -> {result['load_average_after']:.1f}")


if __name__ == "__main__":
    main()
