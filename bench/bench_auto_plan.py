"""What the automatic plan costs at start-up, against one training step.

An architecture with no model file (OLMo; and Llama with its file removed, to compare with the
built-in plan on the same model), at the efficiency table's size (hidden 1024, 4 layers, 16
heads, MLP 2816, vocabulary 8192, batch 4 x 256, fp32), TP=2 on two ranks, one thread each.
Per rank, in order:

- ``derive_s``: the derivation alone (proxy build, two recorded forwards, the pairs' simulations);
- ``verify_s``: the verification alone (sharded proxy against the unsharded one, a collective);
- ``wrap_auto_s``: ``DistributedModel`` with the automatic plan (both of the above, then sharding);
- ``wrap_file_s``: ``DistributedModel`` of the same model with the plan given as a model file
  (sharding only);
- ``step_s``: the median training step (forward + backward + AdamW) of the wrapped model.

``startup_s = wrap_auto_s - wrap_file_s`` is what the automatic plan adds; ``startup_in_steps``
divides it by ``step_s``. Usage: ``python bench/bench_auto_plan.py [--steps 3] [--quick]``;
writes ``bench/results/auto_plan.json`` (``auto_plan_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import bench_tp_vs_hf as tp_bench  # noqa: E402 - the same model shapes and batch

ARCHS = ("olmo", "llama")


def rank(arch: str, steps: int, quick: bool) -> dict:
    """One rank: the timings above for ``arch`` (the slowest rank's counts, as a step's)."""
    from types import MappingProxyType

    import torch

    import modelparallel as smp
    import modelparallel.models as registry
    from modelparallel.models import Architecture
    from modelparallel.tp.auto.plan import derive
    from modelparallel.tp.auto.verify import verify
    from modelparallel.tp.walker import parallelize

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    saved = registry.BUILT_IN
    registry.BUILT_IN = MappingProxyType({t: a for t, a in saved.items() if t != arch})  # as if no file
    try:
        model = tp_bench.build(arch, quick=quick)
        t0 = time.perf_counter()
        spec = derive(model, 2).spec
        t1 = time.perf_counter()
        assert verify(model, spec, smp.tp_mesh(), parallelize) is None
        t2 = time.perf_counter()
        wrapped = smp.DistributedModel(model)
        t3 = time.perf_counter()
        registry.BUILT_IN = MappingProxyType({**saved, arch: Architecture(spec)})  # as a model file gives it
        other = tp_bench.build(arch, quick=quick)
        t4 = time.perf_counter()
        smp.DistributedModel(other)
        t5 = time.perf_counter()
    finally:
        registry.BUILT_IN = saved
    times = tp_bench.timed_steps(wrapped, 1, steps, torch.distributed.barrier, quick)
    out = dict(derive_s=t1 - t0, verify_s=t2 - t1, wrap_auto_s=t3 - t2, wrap_file_s=t5 - t4,
               step_s=statistics.median(times))
    return {k: max(common.slowest([v])) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the efficiency table's --quick sizes")
    args = ap.parse_args()
    result = dict(machine=common.machine(), steps=args.steps, quick=args.quick)
    for arch in ARCHS:
        r = common.spawn(rank, 2, arch, args.steps, args.quick)[0]
        r["startup_s"] = r["wrap_auto_s"] - r["wrap_file_s"]
        r["startup_in_steps"] = r["startup_s"] / r["step_s"]
        result[arch] = r
        print(f"{arch}: derive {r['derive_s']:.2f} s, verify {r['verify_s']:.2f} s, DistributedModel "
              f"{r['wrap_auto_s']:.2f} s automatic vs {r['wrap_file_s']:.2f} s from a file; step {r['step_s']:.2f} s; "
              f"start-up cost {r['startup_s']:.2f} s = {r['startup_in_steps']:.2f} steps", flush=True)
    result["load_average_at_end"] = common.load_average()
    common.write_result("auto_plan_quick" if args.quick else "auto_plan", result)


if __name__ == "__main__":
    main()
