"""Asynchronous checkpoints against synchronous ones and DCP, and saves against the disk's limit.

Two ranks (TP=2, one thread each) hold a GPT-2 with AdamW state (``bench_checkpoint``'s presets;
``medium`` is gpt2-medium's shape, about 4.3 GB per checkpoint). In one run, per repeat:

* ``disk``: each rank writes as many bytes as it saves, in 64 MiB writes, then fsyncs, plain and
  with drop-behind (``bench_checkpoint_disk``'s patterns); the total over the slowest rank's time
  of the faster is the disk's write limit (two writers);
* ``sync``: ``smp.save_checkpoint(partial=True)`` (fsync, checksums, commit); MB/s and its ratio
  to the disk limit;
* ``dcp``: ``torch.distributed.checkpoint.save`` of the same state, fsynced as DCP does;
* ``async``: ``save_checkpoint(..., async_save=True)`` (background staging, the default): the
  time training is blocked is the call plus what the first step after it waits in its step
  pre-hook for the background copy (``hook_wait_s``, recorded by the save's ``Job``), and the
  call's CPU time (``call_cpu_s``: on a shared machine its wall time also counts the time other
  programs held the cores); then
  training steps while the background write runs (their time against steps without a save: the
  slowdown), then ``wait_for_checkpoints`` (the time to commit after the call);
* ``async_read``: the same with the kernel's write tracking turned off (the call reads every
  deferred tensor for its CRC32, as on a machine without it: ``background/pages.py``);
* ``async_sync_staging``: the same with ``async_staging=False`` (everything copied in the call);
* the staging bytes of the asynchronous saver (copied in the call / left to the background) and
  the peak RSS above the process's RSS before the saves (VmHWM reset through
  ``/proc/self/clear_refs``).

Times are the slowest rank's; medians (and min / max: ``spread``) over the repeats after a
warm-up. Usage: ``python bench/bench_checkpoint_async.py [--preset medium|small|tiny]
[--repeats 3]``; writes ``bench/results/checkpoint_async.json`` with the load average before and
after. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_checkpoint as base  # noqa: E402
import bench_checkpoint_disk as disk_bench  # noqa: E402
import common  # noqa: E402


def _disk(work: Path, nbytes: int) -> float:
    """Seconds for every rank to write and fsync ``nbytes`` (slowest rank): the faster of
    ``bench_checkpoint_disk``'s plain and drop-behind patterns."""
    return min(disk_bench._disk(work, nbytes, None), disk_bench._disk(work, nbytes, disk_bench.WRITEBACK, drop=True))


def _step(model, optimizer) -> None:
    import torch

    ids = torch.arange(64).reshape(2, 32) % model.module.config.vocab_size
    model.backward(model(ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()


_WATCH: dict = {}
"""The saver's write tracking, kept while a round turns it off."""


def _async_round(model, optimizer, work: Path, tag: str, steps: int, background: bool, watch: bool = True) -> dict:
    import modelparallel as smp
    from modelparallel import runtime
    from modelparallel.checkpoint.api import _saver

    stager = _saver().stager
    _WATCH.setdefault("watch", stager.pages)
    stager.pages = _WATCH["watch"] if watch else None
    cpu = []

    def save() -> None:
        start = time.process_time()
        smp.save_checkpoint(work / "async", tag, async_save=True, async_staging=background,
                            num_kept_partial_checkpoints=1)
        cpu.append(time.process_time() - start)

    call = base._timed(save)
    saver = runtime.current().checkpoint_saver
    job, copied, deferred = saver.job, saver.stager.copied_bytes, saver.stager.deferred_bytes
    start = time.perf_counter()
    during = []
    for _ in range(steps):
        t = time.perf_counter()
        _step(model, optimizer)
        during.append(time.perf_counter() - t)
    hook_wait = job.held_s  # the first step's wait for staging: training time blocked too
    smp.wait_for_checkpoints()
    committed = common.slowest([time.perf_counter() - start])[0] + call
    return {"call_s": call, "call_cpu_s": common.slowest(cpu)[0], "hook_wait_s": common.slowest([hook_wait])[0],
            "blocked_s": common.slowest([call + hook_wait])[0], "committed_s": committed,
            "step_s_during": statistics.median(during[1:] or during), "first_step_s": during[0],
            "staged_in_call_bytes": copied, "staged_in_background_bytes": deferred}


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def worker(args) -> None:
    import torch.distributed as dist

    import modelparallel as smp

    common.one_thread()
    model, optimizer = base._build(args.preset)
    work = Path(args.work)
    quiet = [base._timed(lambda: _step(model, optimizer)) for _ in range(3)]
    rows: dict[str, list] = {"disk": [], "sync": [], "dcp": [], "async": [], "async_read": [], "async_sync_staging": []}
    rss_base = common.reset_peak()
    for r in range(-1, args.repeats):
        rows["sync"].append(base._timed(lambda: smp.save_checkpoint(work / "sync", f"r{r}",
                                                                    num_kept_partial_checkpoints=1)))
        size = base._dir_bytes(work / "sync" / f"r{r}_partial")
        rows["disk"].append(_disk(work, size // dist.get_world_size()))
        rows["dcp"].append(base._timed(lambda: base._dcp_save(model, optimizer, work / f"dcp{r}")))
        if smp.rank() == 0:
            shutil.rmtree(work / f"dcp{r}")
        rows["async"].append(_async_round(model, optimizer, work, f"r{r}", args.steps, True))
        rows["async_read"].append(_async_round(model, optimizer, work, f"c{r}", args.steps, True, watch=False))
        rows["async_sync_staging"].append(_async_round(model, optimizer, work, f"s{r}", args.steps, False))
        if r < 0:
            rows = {k: [] for k in rows}
    peak = common.slowest([(common.status_mb("VmHWM") - rss_base) * 2**20])[0]
    med = {k: statistics.median(v) for k, v in rows.items() if not k.startswith("async")}
    asy = {k: statistics.median(x[k] for x in rows["async"]) for k in rows["async"][0]}
    quiet_s = statistics.median(quiet)
    spread = {f"{mode}.{k}": _spread([x[k] / (med["sync"] if k == "blocked_s" else 1) for x in rows[mode]])
              for mode in ("async", "async_read", "async_sync_staging") for k in ("blocked_s", "call_s", "hook_wait_s")}
    spread.update({f"{mode}.{k}": _spread([x[k] for x in rows[mode]]) for mode in ("async", "async_read")
                   for k in ("call_cpu_s", "first_step_s")})
    spread.update({f"{mode}.step_slowdown": _spread([x["step_s_during"] / quiet_s for x in rows[mode]])
                   for mode in ("async", "async_read", "async_sync_staging")})
    read = {k: statistics.median(x[k] for x in rows["async_read"]) for k in rows["async_read"][0]}
    result = {"preset": args.preset, "checkpoint_bytes": size, "steps_during_async": args.steps,
              "seconds": rows, "disk_mb_s": size / 1e6 / med["disk"], "sync_mb_s": size / 1e6 / med["sync"],
              "dcp_mb_s": size / 1e6 / med["dcp"], "sync_vs_disk": med["disk"] / med["sync"],
              "async_blocked_s": asy["blocked_s"], "async_blocked_vs_sync": asy["blocked_s"] / med["sync"],
              "async_call_s": asy["call_s"], "async_call_cpu_s": asy["call_cpu_s"],
              "async_hook_wait_s": asy["hook_wait_s"], "write_tracking": _WATCH.get("watch") is not None,
              "async_read_blocked_vs_sync": read["blocked_s"] / med["sync"], "async_read_call_cpu_s": read["call_cpu_s"],
              "async_sync_staging_blocked_vs_sync": statistics.median(x["blocked_s"] for x in rows["async_sync_staging"])
              / med["sync"],
              "spread": spread, "spread_note": "blocked_s entries are fractions of the median sync save",
              "async_committed_s": asy["committed_s"], "step_s_quiet": quiet_s,
              "step_s_during_async": asy["step_s_during"], "step_slowdown_during_async": asy["step_s_during"] / quiet_s,
              "staged_in_call_bytes": asy["staged_in_call_bytes"],
              "staged_in_background_bytes": asy["staged_in_background_bytes"],
              "staging_bytes": smp.checkpoint_staging_bytes(), "peak_rss_above_baseline_bytes": peak}
    if smp.rank() == 0:
        common.report(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(base.PRESETS), default="medium")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds after a warm-up (>= 3 for a spread)")
    ap.add_argument("--steps", type=int, default=3, help="training steps run while each async save is written")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "checkpoint_async.json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()[0]
    result = base.run_in_scratch(__file__, args.dir, "bench-ckpt-async-", ["--preset", args.preset, "--repeats",
                                 str(args.repeats), "--steps", str(args.steps)])
    result["load_average_before"], result["load_average_after"] = load_before, os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{result['preset']}: {result['checkpoint_bytes'] / 1e9:.2f} GB per checkpoint; disk {result['disk_mb_s']:.0f} "
          f"MB/s; sync save {result['sync_mb_s']:.0f} MB/s ({result['sync_vs_disk']:.2f}x the disk), DCP "
          f"{result['dcp_mb_s']:.0f} MB/s; async: blocked {result['async_blocked_s']:.2f} s "
          f"({100 * result['async_blocked_vs_sync']:.1f}% of a sync save: call {result['async_call_s']:.3f} s "
          f"(CPU {result.get('async_call_cpu_s', float('nan')):.3f} s) + "
          f"step hook {result['async_hook_wait_s']:.3f} s; spread {_pct(result['spread']['async.blocked_s'])}; "
          f"write tracking {'on' if result['write_tracking'] else 'unavailable'}; without it (reading) "
          f"{100 * result['async_read_blocked_vs_sync']:.1f}%, CPU {result['async_read_call_cpu_s']:.3f} s; "
          f"staging in the call {100 * result['async_sync_staging_blocked_vs_sync']:.1f}%), committed after "
          f"{result['async_committed_s']:.2f} s, steps {result['step_slowdown_during_async']:.2f}x slower meanwhile; "
          f"staging {result['staging_bytes'] / 1e6:.0f} MB ({result['staged_in_background_bytes'] / 1e6:.0f} MB in the "
          f"background); load average {result['load_average_before']:.1f} before, "
          f"{result['load_average_after']:.1f} after")


def _pct(spread: dict) -> str:
    return "/".join(f"{100 * spread[k]:.1f}" for k in ("min", "median", "max")) + "% (min/median/max)"


if __name__ == "__main__":
    main()
