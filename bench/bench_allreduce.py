"""What one tensor-parallel all-reduce costs on this machine, and how much of it overlapping with a
GEMM can hide.

A Megatron layer at TP=2 sums one [tokens, hidden] activation four times per step (two forward,
two backward); at the benchmark's size (4 x 256 tokens, hidden 1024, fp32) that is 4 MB each.
Two ranks, one compute thread each, gloo: times, per operation and averaged over ``--reps``,

- ``allreduce``: ``dist.all_reduce`` of the 4 MB tensor;
- ``gemm``: the weight-gradient GEMM of a column-parallel ``[2048, 1024]`` layer
  (``[1024, 1024 tokens] @ [1024 tokens, 2048]``), the work Megatron overlaps it with;
- ``sequential``: the two one after the other;
- ``overlapped``: the all-reduce started asynchronously, the GEMM run, then waited for.

``hidden_ms = sequential - overlapped`` is what an overlapped backward could save per all-reduce;
when the collective's transfer needs the CPU the GEMM runs on (gloo over loopback TCP on a small
machine), it is a small part of ``allreduce``.

Usage: ``python bench/bench_allreduce.py [--reps 20] [--rounds 3]``; writes
``bench/results/allreduce.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TOKENS, HIDDEN, OUT = 1024, 1024, 2048


def rank(reps: int, rounds: int) -> dict:
    """One rank: each measurement ``rounds`` times, interleaved; milliseconds per operation."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x = torch.randn(TOKENS, HIDDEN)
    grad, inp = torch.randn(TOKENS, OUT), torch.randn(TOKENS, HIDDEN)

    def allreduce():
        dist.all_reduce(x)

    def gemm():
        return grad.t() @ inp

    def sequential():
        allreduce()
        gemm()

    def overlapped():
        handle = dist.all_reduce(x, async_op=True)
        gemm()
        handle.wait()

    def ms(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        return (time.perf_counter() - t0) / reps * 1e3

    for fn in (allreduce, gemm, overlapped):
        fn()  # warm-up
    fns = dict(allreduce=allreduce, gemm=gemm, sequential=sequential, overlapped=overlapped)
    runs = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            runs[name].append(ms(fn))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    start = common.load_average()
    runs = common.spawn(rank, 2, args.reps, args.rounds)[0]
    med = {name: statistics.median(v) for name, v in runs.items()}
    med["hidden_ms"] = med["sequential"] - med["overlapped"]
    med["hidden_fraction_of_allreduce"] = med["hidden_ms"] / med["allreduce"]
    print(f"4 MB all-reduce {med['allreduce']:.2f} ms, GEMM {med['gemm']:.2f} ms, sequential "
          f"{med['sequential']:.2f} ms, overlapped {med['overlapped']:.2f} ms: overlap hides "
          f"{med['hidden_ms']:.2f} ms ({med['hidden_fraction_of_allreduce']:.0%} of the all-reduce)")
    common.write_result("allreduce", dict(tokens=TOKENS, hidden=HIDDEN, out=OUT, reps=args.reps,
                                          rounds=args.rounds, load_average_at_start=start, runs=runs,
                                          median_ms=med))


if __name__ == "__main__":
    main()
