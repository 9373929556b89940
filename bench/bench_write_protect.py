"""Write-protecting an asynchronous save's deferred tensors: the two ways the kernel offers, side by side.

Where Linux tracks writes (``checkpoint/background/pages.py``), an asynchronous save's call
write-protects the pages of every tensor it leaves to the background copy; that page-table walk
is most of the call's time at a few hundred megabytes per rank. Two requests do it:
``UFFDIO_WRITEPROTECT`` on the userfaultfd (what the watch used before) and ``PAGEMAP_SCAN``'s
protect-while-walking with no output asked (what it uses now). Per repeat, in one process, for
each size: tensors like a rank's parameters and optimizer slots (``--tensors`` of them), then a
cycle as repeated saves run it: every page written (an optimizer step), the save's protection
timed (``PageWatch.protect_claimed``: mappings read, registered, each tensor's whole pages
protected), the copies' end (protections cleared, registrations ended). The two ways alternate,
each after the other's clearing, so each meets the page state a save in steady state meets.

Usage: ``python bench/bench_write_protect.py [--sizes-mb 63 466 2136] [--tensors 117] [--repeats 5]``
(about half a minute); writes ``bench/results/write_protect.json``. One thread; run it on a
quiet machine. Linux 6.7+ only (elsewhere the watch does not open and nothing is measured).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _ways(watch):
    from modelparallel.checkpoint.background import uffd as abi

    def uffd_writeprotect(lo: int, hi: int, on: bool = True) -> None:
        watch.kernel.ioctl(watch.uffd, abi.UFFDIO_WRITEPROTECT, lo, hi - lo, 1 if on else 0)

    return {"pagemap_scan": watch._protect, "uffdio_writeprotect": uffd_writeprotect}


def _measure(size_mb: int, tensors: int, repeats: int) -> dict:
    import torch

    from modelparallel.checkpoint.background.pages import PageWatch

    watch = PageWatch.open()
    if watch is None:
        raise SystemExit("no write tracking on this machine (Linux 6.7+ with userfaultfd's asynchronous mode)")
    watch.min_save_bytes = 0
    memory = [torch.randn(size_mb * 2**20 // 4 // tensors) for _ in range(tensors)]
    ways = _ways(watch)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats + 1):  # the first round warms up
        for name, protect in ways.items():
            for t in memory:
                t.add_(1.0)  # the step: every page written since the last save
            watch._protect = protect
            watch.start()
            for t in memory:
                watch.claim(t)
            t0 = time.perf_counter()
            refused = watch.protect_claimed()
            times[name].append(time.perf_counter() - t0)
            assert not refused, "the kernel refused to protect a tensor"
            watch.release()
            watch.unregister()
    out = {name: common.spread(v[1:]) for name, v in times.items()}
    out["ratio_uffd_over_scan"] = out["uffdio_writeprotect"]["median"] / out["pagemap_scan"]["median"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[63, 466, 2136])
    ap.add_argument("--tensors", type=int, default=117)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    common.one_thread()
    before = common.load_average()
    results = {}
    for size in args.sizes_mb:
        r = results[str(size)] = _measure(size, args.tensors, args.repeats)
        scan, uffd = r["pagemap_scan"], r["uffdio_writeprotect"]
        print(f"{size} MB in {args.tensors} tensors: PAGEMAP_SCAN {scan['median'] * 1e3:.1f} ms "
              f"({scan['min'] * 1e3:.1f}-{scan['max'] * 1e3:.1f}), UFFDIO_WRITEPROTECT {uffd['median'] * 1e3:.1f} ms "
              f"({uffd['min'] * 1e3:.1f}-{uffd['max'] * 1e3:.1f}): {r['ratio_uffd_over_scan']:.2f}x")
    common.write_result("write_protect", {"bench": "write_protect", "tensors": args.tensors, "repeats": args.repeats,
                                          "load_average_before": before, "results_by_mb": results}, args.out)


if __name__ == "__main__":
    main()
