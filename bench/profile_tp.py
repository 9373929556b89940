"""Where a TP=2 training step's time goes, per rank, against the one-process Hugging Face step.

For each architecture of ``bench_tp_vs_hf.py`` (same models, same batch, fwd + bwd + AdamW, one
thread per rank), one step is profiled with ``torch.profiler`` at TP=1 (plain HF model) and at
TP=2 (modelparallel, two ranks), and its wall time is split into:

- ``gemm``: self time of mm / addmm / bmm / baddbmm (compared with half of TP=1's: the ideal);
- ``attention``: fused attention kernels (scaled_dot_product...);
- ``comm``: collectives and waiting for them (c10d ops, ``wait_tensor``, ``dist.all_reduce``);
- ``copy``: copy_ / clone / contiguous / cat / _to_copy;
- ``views``: metadata-only ops (view, t, transpose, permute, expand, detach, empty...);
- ``elementwise``: every other ATen op outside the optimizer (norms, activations, adds, softmax);
- ``optimizer``: everything inside ``Optimizer.step`` / ``zero_grad``;
- ``framework``: the rest of the wall time, i.e. not inside any ATen kernel: Python, autograd
  engine bookkeeping, DTensor sharding propagation and wrapping.

It also counts, per step and independently of machine load: ATen calls by name (mm, addmm, copy_,
contiguous, permute...), bytes written by copies, collectives by kind with their sizes, and ops
dispatched on DTensors. These counts are what the optimizations in ``modelparallel/tp`` are checked
against while the machine is busy; times need a quiet machine.

The hardware ceiling: two single-thread TP=1 processes started side by side against one alone
(``--ceiling``): if each of the pair is as fast as the lone one, two ranks do not contend for
cores or memory bandwidth and an efficiency of 1 minus the collectives' cost is reachable.

Usage: ``python bench/profile_tp.py [--archs llama,gpt2] [--quick] [--ceiling] [--baseline-ref REV]``;
writes ``bench/results/tp_profile[_quick].json`` and prints a table per architecture.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_tp_vs_hf import ARCHS, batch, build  # noqa: E402
from profile_parts import (CATEGORIES, COUNTED, _wrap_collectives, analyse, dtensor_op_counts,  # noqa: E402
                           gemm_calls, replay_gemms)

RESULTS = common.RESULTS_DIR / "tp_profile.json"
def worker(args) -> None:
    """One rank: warm up, count DTensor ops over one step, then profile ``--steps`` steps."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.method == "tp1":
        model = build(args.arch, quick=args.quick)
    else:
        import modelparallel as smp

        smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})  # same batch on both ranks, as TP=1 and HF
        model = smp.DistributedModel(build(args.arch, quick=args.quick))
        _wrap_collectives()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = batch(args.quick)
    sync = dist.barrier if dist.is_initialized() else (lambda: None)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    dtensor_ops = dtensor_op_counts(step) if args.method != "tp1" else Counter()
    gemms = replay_gemms(gemm_calls(step))
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
    row = analyse(prof, walls)
    row.update(rank=dist.get_rank() if dist.is_initialized() else 0, method=args.method, arch=args.arch,
               dtensor_ops=sum(dtensor_ops.values()), dtensor_ops_by_name=dict(dtensor_ops.most_common()),
               gemm_replay_cpu_s=sum(g["cpu_s"] for g in gemms), gemm_replay=gemms)
    common.report(row)


def run(method: str, arch: str, nproc: int, args, source: str = "", wait: bool = True):
    """Profile one job (``wait=False``: started, for ``common.finish``); each rank's record."""
    extra = ["--worker", "--method", method, "--arch", arch, "--steps", str(args.steps), "--warmup",
             str(args.warmup)] + (["--quick"] if args.quick else [])
    job = common.start(__file__, nproc, extra, source=source)
    return common.finish(job) if wait else job


def ceiling(args, arch: str = "llama") -> dict:
    """One TP=1 process alone, then two side by side: the step-time ratio pair / alone."""
    alone = run("tp1", arch, 1, args)[0]["step_s"]
    pair = [common.finish(h)[0]["step_s"] for h in [run("tp1", arch, 1, args, wait=False) for _ in range(2)]]
    return dict(arch=arch, alone_s=alone, side_by_side_s=pair, slowdown=max(pair) / alone)


def summarize(tp1: dict, ranks: list[dict]) -> dict:
    worst = max(ranks, key=lambda r: r["step_s"])
    return dict(tp1=tp1, tp2=ranks, efficiency=tp1["step_s"] / (2 * worst["step_s"]),
                gemm_vs_half_tp1=worst["seconds"]["gemm"] / (tp1["seconds"]["gemm"] / 2),
                gemm_cpu_vs_half_tp1=max(r["gemm_replay_cpu_s"] for r in ranks) / (tp1["gemm_replay_cpu_s"] / 2))


def print_table(arch: str, s: dict, before: dict | None) -> None:
    t1, t2 = s["tp1"], max(s["tp2"], key=lambda r: r["step_s"])
    cols = [("TP=1 HF", t1, 1.0), ("TP=2 ours", t2, 2.0)] + ([("TP=2 before", max(
        before["tp2"], key=lambda r: r["step_s"]), 2.0)] if before else [])
    print(f"\n{arch}: efficiency {s['efficiency']:.3f} (profiled), GEMM per rank / half TP=1 "
          f"{s['gemm_vs_half_tp1']:.2f} (wall), {s['gemm_cpu_vs_half_tp1']:.2f} (replayed, CPU time)"
          + (f"; before {before['efficiency']:.3f}, GEMM {before['gemm_cpu_vs_half_tp1']:.2f}" if before else ""))
    print("| per step | " + " | ".join(c[0] for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for c in CATEGORIES:
        print(f"| {c}, s | " + " | ".join(f"{r['seconds'][c]:.3f}" for _, r, _ in cols) + " |")
    print("| step, s | " + " | ".join(f"{r['step_s']:.3f}" for _, r, _ in cols) + " |")
    for k in COUNTED:
        print(f"| {k} calls | " + " | ".join(f"{r['counts'][k]:.0f}" for _, r, _ in cols) + " |")
    print("| copy MB | " + " | ".join(f"{r['copy_mb']:.1f}" for _, r, _ in cols) + " |")
    print("| GEMM replay CPU s | " + " | ".join(f"{r['gemm_replay_cpu_s']:.3f}" for _, r, _ in cols) + " |")
    print("| DTensor ops | " + " | ".join(str(r.get("dtensor_ops", 0)) for _, r, _ in cols) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the small models of bench_tp_vs_hf --quick")
    ap.add_argument("--ceiling", action="store_true", help="also run two TP=1 processes side by side")
    ap.add_argument("--baseline-ref", default="", help="git revision profiled as the 'before' TP=2 column")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="", help=argparse.SUPPRESS)
    ap.add_argument("--arch", default="llama", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    archs = [a for a in args.archs.split(",") if a]
    if set(archs) - set(ARCHS):
        ap.error(f"unknown architectures {sorted(set(archs) - set(ARCHS))}; known: {', '.join(ARCHS)}")
    result = dict(quick=args.quick, steps=args.steps, load_average_at_start=list(os.getloadavg()), archs={})
    before_src = common.checkout(args.baseline_ref) if args.baseline_ref else ""
    try:
        for arch in archs:
            tp1 = run("tp1", arch, 1, args)[0]
            result["archs"][arch] = summarize(tp1, run("tp2", arch, 2, args))
            before = summarize(tp1, run("tp2", arch, 2, args, source=before_src)) if before_src else None
            if before:
                result["archs"][arch]["before"] = before
            print_table(arch, result["archs"][arch], before)
        if args.ceiling:
            result["ceiling"] = ceiling(args)
            c = result["ceiling"]
            print(f"\nceiling ({c['arch']}): alone {c['alone_s']:.3f} s, side by side "
                  f"{', '.join(f'{t:.3f}' for t in c['side_by_side_s'])} s: slowdown {c['slowdown']:.3f}")
    finally:
        if before_src:
            common.drop_checkout(before_src)
    result["load_average_at_end"] = list(os.getloadavg())
    print(f"load average at start {result['load_average_at_start']}, at end {result['load_average_at_end']}")
    out = RESULTS.with_name("tp_profile_quick.json") if args.quick else RESULTS
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
