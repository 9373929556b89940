"""Pipeline parallelism: throughput at P=2 against P=1 and the bubble bound, per-stage busy and
idle time, activation memory of the two schedules, parameter bytes and stage balance.

A GPT-2 whose layers dominate (n_embd 256, 8 layers, 8 heads, vocabulary 512), batch 16 x 256,
fp32, dropout off, ``microbatches`` 8; one step = ``@smp.step`` (forward + backward of every
microbatch) + AdamW. Runs, each a separate job of fresh processes (one thread per rank):

- ``p1``: one process, the same ``@smp.step`` with 8 microbatches (the baseline);
- ``p2_simple`` / ``p2_interleaved``: ``pipeline_parallel_degree`` 2 with ``pipeline`` "simple"
  (GPipe: all forwards, then all backwards) and "interleaved" (1F1B);
- ``p4_interleaved`` with ``--p4`` (only meaningful with a core per rank).

Per run and rank: median step time (a step's time is the slowest rank's), tokens/s; busy time
(the time inside the stage's ``forward_one_chunk`` / ``backward_one_chunk``, the schedule's
compute) and idle = step - busy; peak RSS rise during a step over the RSS before it (the
activations held at once: GPipe holds all M microbatches', 1F1B about P); the stage's parameter
bytes against the whole model's / P. Derived: the bubble bound on throughput,
``P x p1 x M / (M + P - 1)``, and measured / bound (goal >= 0.95); stage balance = max / mean busy
time over the stages (goal <= 1.1).

Every run is repeated ``--repeats`` times (all runs once, then again), each repeat's ratios
against that repeat's ``p1``; ``spread`` gives min / median / max over the repeats.

Usage: ``python bench/bench_pipeline.py [--steps 4] [--warmup 1] [--repeats 3] [--p4]``; writes
``bench/results/pipeline.json``. About 1 minute per run on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import common
import modelparallel as smp

BATCH, SEQ, VOCAB, MICROBATCHES = 16, 256, 512, 8


def build() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=8, n_head=8, n_positions=SEQ, vocab_size=VOCAB,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                      eos_token_id=2))


def _timed(fn, box: list):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            box[0] += time.perf_counter() - start
    return run


def _watch_stages(model, box: list) -> None:
    """Time the schedules' stage compute (each cached schedule's ``PipelineStage``) once."""
    for schedule in model._mp_pipeline.schedules.values():
        stage = schedule._stage
        if not getattr(stage, "_bench_timed", False):
            stage.forward_one_chunk = _timed(stage.forward_one_chunk, box)
            stage.backward_one_chunk = _timed(stage.backward_one_chunk, box)
            stage._bench_timed = True


def rank_run(pp: int, schedule: str, steps: int, warmup: int) -> dict:
    smp.init({"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES, "pipeline": schedule,
              "random_seed": 0})
    baseline = common.baseline_mb()
    full = build()
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    model = smp.DistributedModel(full)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    stage_bytes = sum(p.numel() * p.element_size() for p in model.module.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    @smp.step
    def train_step(x):
        loss = model(x, labels=x).loss
        model.backward(loss)
        return loss

    times, busy, rises, losses = [], [], [], []
    box = [0.0]  # the stage compute of the current step (the timers, installed once, add to it)
    for i in range(warmup + steps):
        box[0] = 0.0
        if pp > 1 and i >= warmup:
            _watch_stages(model, box)
        before = common.reset_peak()
        start = time.perf_counter()
        loss = train_step(ids).reduce_mean()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
            busy.append(box[0])
            rises.append(common.status_mb("VmHWM") - before)
        losses.append(loss.item())
    return {"times": common.slowest(times), "busy": busy, "rss_rise_mb": max(rises), "stage_param_bytes": stage_bytes,
            "model_param_bytes": full_bytes, "first_loss": losses[0],
            "peak_above_baseline_mb": common.peak_above_baseline_mb(baseline, model.module),
            "load": common.load_average()}


def summarize(name: str, pp: int, ranks: list[dict], p1_tokens_s: float | None) -> dict:
    median = statistics.median(ranks[0]["times"])  # every rank holds the slowest rank's times
    out = {"pp": pp, "median_step_s": median, "tokens_per_s": BATCH * SEQ / median, "ranks": ranks}
    if pp > 1:
        busy = [statistics.median(r["busy"]) for r in ranks]
        out["busy_s"] = busy
        out["idle_s"] = [median - b for b in busy]
        out["balance_max_over_mean"] = max(busy) / statistics.mean(busy)
        out["param_bytes_over_model_per_p"] = [r["stage_param_bytes"] / (r["model_param_bytes"] / pp) for r in ranks]
        if p1_tokens_s:
            bound = pp * p1_tokens_s * MICROBATCHES / (MICROBATCHES + pp - 1)
            out["bubble_bound_tokens_per_s"] = bound
            out["measured_over_bound"] = out["tokens_per_s"] / bound
    print(f"{name}: {median:.3f} s/step, {out['tokens_per_s']:,.0f} tok/s"
          + (f", {out['measured_over_bound']:.2f} of the bubble bound" if "measured_over_bound" in out else "")
          + (f", balance {out['balance_max_over_mean']:.2f}" if pp > 1 else "")
          + f", RSS rise {[round(r['rss_rise_mb']) for r in ranks]} MB", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--p4", action="store_true", help="also P=4 (1F1B) on 4 ranks")
    args = ap.parse_args()
    runs = [("p1", 1, "simple"), ("p2_simple", 2, "simple"), ("p2_interleaved", 2, "interleaved")]
    if args.p4:
        runs.append(("p4_interleaved", 4, "interleaved"))
    repeats = []
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}", flush=True)
        one, p1 = {}, None
        for name, pp, schedule in runs:
            ranks = common.spawn(rank_run, pp, pp, schedule, args.steps, args.warmup)
            one[name] = summarize(name, pp, ranks, p1)
            p1 = one["p1"]["tokens_per_s"]
        repeats.append(one)
    metrics = ("tokens_per_s", "measured_over_bound", "balance_max_over_mean")
    result = {"batch": BATCH, "seq": SEQ, "microbatches": MICROBATCHES, "repeats": repeats,
              "spread": {name: {m: common.spread(rep[name][m] for rep in repeats) for m in metrics if m in repeats[0][name]}
                         for name, _, _ in runs}}
    for name, metrics_of in result["spread"].items():
        print(name, ", ".join(f"{m} {v['median']:.3g} ({v['min']:.3g}-{v['max']:.3g})" for m, v in metrics_of.items()))
    path = common.write_result("pipeline", result)
    print(f"written {path}")


if __name__ == "__main__":
    main()
