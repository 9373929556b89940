"""Step time of ``@smp.step`` (microbatches 1 and 4) against a plain PyTorch loop, same batch.

One process, one thread, a small GPT-2 (n_embd 256, 4 layers, vocabulary 8192), batch 8 x 128,
fp32; one step = forward + backward + AdamW. Two phases (``smp.init`` with microbatches 1, then
4); in each, the plain loop and ``@smp.step`` take turns step by step so a change of machine load
hits both alike. Phase 1 also runs the same ``DistributedModel`` in a plain loop without the
decorator, separating the wrapper's cost from ``@smp.step``'s. Reported: median step times and the ratio of ``@smp.step`` to the plain loop of
the same phase, plus the load averages.

Usage: ``python bench/bench_smp_step.py [--steps 8] [--warmup 2]``; writes
``bench/results/smp_step.json``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import common
import modelparallel as smp

BATCH, SEQ, VOCAB = 8, 128, 8192


def plain_runner(ref: torch.nn.Module):
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return run


def smp_runner(ref: torch.nn.Module, microbatches: int, use_step: bool = True):
    smp.init({"microbatches": microbatches})
    model = smp.DistributedModel(copy.deepcopy(ref))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    if not use_step:  # the same wrapped model and optimizer in a plain loop
        def run_loop(ids):
            loss = model(ids, labels=ids).loss
            model.backward(loss)
            opt.step()
            opt.zero_grad()
            return loss.item()

        return run_loop

    @smp.step
    def train_step(ids):
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        return loss

    def run(ids):
        loss = train_step(ids).reduce_mean()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    common.one_thread()
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=8, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    load_before = common.load_average()
    times, first_loss = {}, {}
    for mb in (1, 4):
        runs = {f"plain_phase{mb}": plain_runner(ref), f"smp_step_mb{mb}": smp_runner(ref, mb)}
        if mb == 1:  # separates the wrapper's cost from the decorator's
            runs["smp_loop_no_step"] = smp_runner(ref, 1, use_step=False)
        for name in runs:
            times[name] = []
        for i in range(args.warmup + args.steps):
            for name, run in runs.items():
                t0 = time.perf_counter()
                loss = run(ids)
                dt = time.perf_counter() - t0
                first_loss.setdefault(name, loss)
                if i >= args.warmup:
                    times[name].append(dt)
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "load_average_before": load_before, "batch": BATCH, "seq": SEQ, "vocab": VOCAB,
        "times_s": times, "median_s": medians,
        "ratio_vs_plain": {**{f"smp_step_mb{mb}": medians[f"smp_step_mb{mb}"] / medians[f"plain_phase{mb}"]
                              for mb in (1, 4)},
                           "smp_loop_no_step": medians["smp_loop_no_step"] / medians["plain_phase1"]},
        "ratio_step_mb1_vs_smp_loop": medians["smp_step_mb1"] / medians["smp_loop_no_step"],
        "first_loss": first_loss,
    }
    for name in times:
        ratio = result["ratio_vs_plain"].get(name)
        print(f"{name:14s} median {medians[name]:.3f} s  {'' if ratio is None else f'x{ratio:.3f} vs plain  '}"
              f"first loss {first_loss[name]:.4f}")
    common.write_result("smp_step", result)


if __name__ == "__main__":
    main()
