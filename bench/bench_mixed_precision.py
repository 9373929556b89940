"""Mixed precision at TP=2 on CPU: step time, peak memory and bytes kept per parameter, for
fp32, bf16 (fp32 master weights) and fp16 (fp32 masters + dynamic loss scaling).

One step is forward + backward + ``DistributedOptimizer`` (AdamW) step on a GPT-2 of n_embd 512,
4 layers, vocabulary 8192, batch 4 x 128 tokens, one thread per rank. Each precision runs in its
own 2-rank job (``common.spawn``) so that the peak resident memory (``VmHWM`` minus the resident size
after imports) is that precision's alone. Bytes per parameter are counted from the tensors
themselves on rank 0 (local shards): model weights, gradients (as left by backward), fp32
masters, optimizer state (AdamW's two moments).

CPUs without native half-precision matrix units run bf16/fp16 matmuls slower than fp32; on GPUs
the ratio is the other way round. The machine this ran on was shared (load average recorded).

Usage: ``python bench/bench_mixed_precision.py [--steps 4] [--warmup 2]``; writes
``bench/results/mixed_precision.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common

SHAPE = dict(n_embd=512, n_layer=4, n_head=8, vocab_size=8192, n_positions=256)
BATCH, SEQ, SEED = 4, 128, 0
DTYPES = ("fp32", "bf16", "fp16")


def _bytes_per_param(model, opt) -> dict[str, float]:
    import torch
    from modelparallel.training.master_weights import local

    params = list(model.parameters())
    n = sum(local(p).numel() for p in params)
    size = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    masters = [m for _, m in opt.master_weights.pairs]
    state = [v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim()]
    return {"weights": size(params) / n, "grads": size([p.grad for p in params if p.grad is not None]) / n,
            "master": size(masters) / n, "optimizer_state": size(state) / n}


def worker(dtype: str, warmup: int, steps: int) -> dict | None:
    """One rank of one precision's job; rank 0 returns the measurements."""
    import torch
    import transformers

    import modelparallel as smp

    base = common.baseline_mb()
    smp.init({"tensor_parallel_degree": 2, "fp16": dtype == "fp16", "bf16": dtype == "bf16"})
    torch.manual_seed(SEED)
    cfg = transformers.GPT2Config(**SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = smp.DistributedModel(transformers.GPT2LMHeadModel(cfg))
    scaling = {"static_loss_scale": None, "dynamic_loss_scale": True,
               "dynamic_loss_args": {"init_scale": 2.0 ** 12}} if dtype == "fp16" else {}
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), **scaling)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    times, losses, per_param = [], [], None
    for i in range(warmup + steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        if i == warmup + steps - 1:
            per_param = _bytes_per_param(model, opt)  # gradients still held
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= warmup:
            times.append(elapsed)
    peak_mb = common.peak_above_baseline_mb(base, model)
    if smp.rank() != 0:
        return None
    return {"dtype": dtype, "step_s": times, "median_step_s": statistics.median(times), "losses": losses,
            "peak_mb_above_imports": peak_mb, "bytes_per_param": per_param, "loss_scale": opt.loss_scaler.loss_scale}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    load_before = common.load_average()
    runs = {dtype: common.spawn(worker, 2, dtype, args.warmup, args.steps)[0] for dtype in DTYPES}
    base = runs["fp32"]
    for r in runs.values():
        r["step_time_vs_fp32"] = r["median_step_s"] / base["median_step_s"]
        r["peak_memory_vs_fp32"] = r["peak_mb_above_imports"] / base["peak_mb_above_imports"]
    result = {"shape": SHAPE, "batch": BATCH, "seq": SEQ, "tp": 2, "steps": args.steps,
              "load_average_before": load_before, "runs": runs}
    print("| dtype | step (s, median) | vs fp32 | peak MB/rank | vs fp32 | bytes/param: weights, grads, "
          "master, optimizer state |")
    print("|---|---|---|---|---|---|")
    for d, r in runs.items():
        b = r["bytes_per_param"]
        print(f"| {d} | {r['median_step_s']:.3f} | {r['step_time_vs_fp32']:.2f}x | {r['peak_mb_above_imports']:.0f} "
              f"| {r['peak_memory_vs_fp32']:.2f}x | {b['weights']:.0f}, {b['grads']:.0f}, {b['master']:.0f}, "
              f"{b['optimizer_state']:.0f} |")
    common.write_result("mixed_precision", result)


if __name__ == "__main__":
    main()
