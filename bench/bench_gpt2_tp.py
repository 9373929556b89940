"""GPT-2 training-step benchmark on CPU: plain Hugging Face (TP=1) against modelparallel at TP=2.

One step is forward + backward + AdamW on a GPT-2 of n_embd 1024, 4 layers, 16 heads, the full
50257-token vocabulary, batch 4 x 256 tokens, fp32, dropout off. Each rank gets one thread, so
TP=2 uses two cores where the baseline uses one and the ideal speedup is 2: the shortfall is what
the collectives and the replicated work (layer norms, embeddings of positions) cost.

It also counts the collectives of one forward + backward at TP=2 by kind and by transformer
layer: Megatron-style tensor parallelism needs exactly two all-reduces per layer forward (after
attention's and the MLP's row-parallel projection) and two backward (before the column-parallel
ones), plus a constant for the vocab-parallel embedding and loss.

Usage: ``python bench/bench_gpt2_tp.py [--steps 5] [--warmup 2]``; writes
``bench/results/gpt2_tp.json``. The TP=2 (and modelparallel TP=1) runs are started by this script
itself (``common.spawn``). Peak memory is the resident peak above the post-import baseline, after
touching every parameter.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
import warnings
from collections import defaultdict
from pathlib import Path

import common

SHAPE = dict(n_embd=1024, n_layer=4, n_head=16, vocab_size=50257, n_positions=1024)
BATCH, SEQ, LR, SEED = 4, 256, 1e-4, 0


def build_model():
    """The benchmark GPT-2, identical in every process (same seed), dropout off."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    cfg = GPT2Config(**SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def make_batch():
    """Random token ids, the same in every process; labels = inputs (HF shifts them)."""
    import torch

    return torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))


def time_steps(step, warmup: int, steps: int, barrier=lambda: None, progress: str = "") -> tuple[list[float], float]:
    """(seconds of each timed step, loss of the first step). Warm-up steps are run untimed:
    the first steps allocate buffers and AdamW's state."""
    times, first_loss = [], None
    for i in range(warmup + steps):
        barrier()
        start = time.perf_counter()
        loss = step()
        elapsed = time.perf_counter() - start
        first_loss = loss if first_loss is None else first_loss
        if i >= warmup:
            times.append(elapsed)
        if progress:
            kind = "warm-up" if i < warmup else "timed"
            print(f"  {progress} step {i + 1}/{warmup + steps} ({kind}): {elapsed:.2f} s, loss {loss:.4f}", flush=True)
    return times, first_loss


def run_hf_reference(args) -> dict:
    """The TP=1 baseline: plain ``GPT2LMHeadModel`` and ``torch.optim.AdamW``, one thread."""
    import torch

    common.one_thread()
    base = common.baseline_mb()
    model, x = build_model(), make_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step():
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    times, loss0 = time_steps(step, args.warmup, args.steps, progress="hf tp=1")
    return {"times_s": times, "median_s": statistics.median(times), "min_s": min(times), "first_loss": loss0,
            "threads": torch.get_num_threads(), "peak_rss_mb": common.peak_above_baseline_mb(base, model)}


def kind_of(op) -> str:
    """A collective's kind from its op name, whichever API (c10d, functional, native) issued it."""
    name = str(op).lower().replace("_", "")
    for kind in ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall", "send", "recv"):
        if kind in name:
            return {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
                    "alltoall": "all_to_all"}.get(kind, kind)
    return str(op)


def count_collectives(model, x) -> dict:
    """Collectives of one forward + backward by kind, in total and per transformer layer."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with warnings.catch_warnings():  # its module tracker's hook warnings on HF output classes
        warnings.simplefilter("ignore", UserWarning)
        with mode:
            model(x, labels=x).loss.backward()
    model.zero_grad(set_to_none=True)
    per_module = mode.comm_module_counts
    def tally(counts):
        out = defaultdict(int)
        for op, n in counts.items():
            out[kind_of(op)] += n
        return dict(out)
    total = {phase: tally(per_module.get("Global", {}).get(phase, {})) for phase in ("forward", "backward")}
    layers = {}
    for fqn, phases in per_module.items():
        m = re.search(r"\.h\.(\d+)$", fqn)
        if m:
            layers[int(m.group(1))] = {phase: tally(phases[phase]) for phase in ("forward", "backward")}
    layers = {f"h.{i}": layers.get(i, {"forward": {}, "backward": {}}) for i in range(SHAPE["n_layer"])}
    outside = {phase: {k: v - sum(layer[phase].get(k, 0) for layer in layers.values())
                       for k, v in total[phase].items()} for phase in total}
    return {"total": total, "per_layer": layers, "outside_layers": outside,
            "global_op_counts": {str(k): v for k, v in mode.get_comm_counts().items()}}


def run_smp_worker(warmup: int, steps: int) -> dict | None:
    """One rank of a modelparallel run; rank 0 returns the result."""
    import torch
    import torch.distributed as dist

    import modelparallel as smp

    base = common.baseline_mb()
    smp.init({"tensor_parallel_degree": int(os.environ["WORLD_SIZE"]), "random_seed": SEED,
              "prescaled_batch": True})  # every rank the same batch, as the TP=1 baseline
    model, x = smp.DistributedModel(build_model()), make_batch()
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    comms = count_collectives(model, x) if smp.tp_size() > 1 else None

    def step():
        loss = model(x, labels=x).loss
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    tag = f"smp tp={smp.tp_size()}" if smp.rank() == 0 else ""
    times, loss0 = time_steps(step, warmup, steps, barrier=dist.barrier, progress=tag)
    times = common.slowest(times)
    rss = common.slowest([common.peak_above_baseline_mb(base, model)])[0]
    if smp.rank() != 0:
        return None
    return {"times_s": times, "median_s": statistics.median(times), "min_s": min(times), "first_loss": loss0,
            "tp": smp.tp_size(), "threads_per_rank": torch.get_num_threads(), "peak_rss_mb_per_rank": rss,
            "collectives": comms}


def launch_smp(args, nproc: int) -> dict:
    """Run the modelparallel worker on ``nproc`` ranks (one thread each)."""
    return common.spawn(run_smp_worker, nproc, args.warmup, args.steps)[0]


def with_load(fn, *args) -> dict:
    """``fn``'s result plus the 1-minute load average after it: this benchmark wants the cores to
    itself, and a load above the core count means something else shared them while it ran."""
    result = fn(*args)
    result["load_average_1min_after"] = common.load_average()[0]
    return result


def summarize(hf: dict, tp1: dict | None, tp2: dict) -> dict:
    """Speedup and efficiency against the HF baseline, and the per-layer collective check."""
    speedup = hf["median_s"] / tp2["median_s"]
    layer_counts = {name: {ph: c[ph].get("all_reduce", 0) for ph in c} for name, c in
                    tp2["collectives"]["per_layer"].items()}
    out = {"speedup_tp2_vs_hf": speedup, "efficiency_tp2": speedup / 2,
           "speedup_tp2_vs_hf_best_step": hf["min_s"] / tp2["min_s"],
           "tokens_per_s": {"hf_tp1": BATCH * SEQ / hf["median_s"], "smp_tp2": BATCH * SEQ / tp2["median_s"]},
           "first_loss_abs_diff_tp2_vs_hf": abs(tp2["first_loss"] - hf["first_loss"]),
           "all_reduce_per_layer": layer_counts,
           "two_plus_two_per_layer": all(c == {"forward": 2, "backward": 2} for c in layer_counts.values())}
    if tp1:
        out["smp_tp1_overhead_vs_hf"] = tp1["median_s"] / hf["median_s"] - 1
        out["tokens_per_s"]["smp_tp1"] = BATCH * SEQ / tp1["median_s"]
    return out


def print_table(hf: dict, tp1: dict | None, tp2: dict, s: dict) -> None:
    print("\nGPT-2 n_embd 1024, 4 layers, 16 heads, vocab 50257, batch 4 x 256, fp32, one thread per rank")
    print(f"{'run':<28}{'median step':>12}{'tokens/s':>10}{'vs HF':>8}{'best step':>11}{'vs HF':>8}")
    rows = [("HF GPT2LMHeadModel, TP=1", hf), ("modelparallel, TP=1", tp1), ("modelparallel, TP=2", tp2)]
    for name, r in rows:
        if r:
            print(f"{name:<28}{r['median_s']:>10.3f} s{BATCH * SEQ / r['median_s']:>10.0f}"
                  f"{hf['median_s'] / r['median_s']:>7.2f}x{r['min_s']:>9.3f} s{hf['min_s'] / r['min_s']:>7.2f}x")
    print(f"speedup TP=2 vs HF {s['speedup_tp2_vs_hf']:.2f}x (median), efficiency {s['efficiency_tp2']:.0%}; "
          f"best steps {s['speedup_tp2_vs_hf_best_step']:.2f}x; "
          f"first-step loss |TP=2 - HF| = {s['first_loss_abs_diff_tp2_vs_hf']:.2e}")
    c = tp2["collectives"]
    print(f"\ncollectives per forward+backward at TP=2: forward {c['total']['forward']}, "
          f"backward {c['total']['backward']}")
    for name, counts in s["all_reduce_per_layer"].items():
        print(f"  {name}: all_reduce forward {counts['forward']}, backward {counts['backward']}")
    print(f"  outside the layers (embedding, head, loss): {c['outside_layers']}")
    print(f"  2 forward + 2 backward all-reduces per layer: {'yes' if s['two_plus_two_per_layer'] else 'NO'}")
    busy = [r["load_average_1min_after"] for r in (hf, tp1, tp2) if r]
    if max(busy) > (os.cpu_count() or 1):
        print(f"\nWARNING: 1-minute load averages {busy} exceed the {os.cpu_count()} cores: other processes "
              "competed for the CPU and the times above are inflated by an unknown amount.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--skip-smp-tp1", action="store_true", help="skip modelparallel at TP=1 (wrapper overhead)")
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/gpt2_tp.json")
    args = p.parse_args()
    info = common.machine()
    print(f"torch {info['torch']}, {info['cores']} cores ({info['cpu']}), load {info['load_average']}")
    t0 = time.time()
    hf = with_load(run_hf_reference, args)
    tp2 = with_load(launch_smp, args, 2)  # right after the baseline: the pair that matters most
    tp1 = None if args.skip_smp_tp1 else with_load(launch_smp, args, 1)
    s = summarize(hf, tp1, tp2)
    print_table(hf, tp1, tp2, s)
    common.write_result("gpt2_tp", {
        "load_average_at_start": info["load_average"],
        "shape": {**SHAPE, "batch": BATCH, "seq": SEQ, "dtype": "float32", "dropout": 0.0},
        "steps": args.steps, "warmup": args.warmup, "hf_tp1": hf, "smp_tp1": tp1, "smp_tp2": tp2,
        "summary": s, "bench_wall_time_s": time.time() - t0}, args.out)


if __name__ == "__main__":
    main()
