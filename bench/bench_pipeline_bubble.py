"""The pipeline bubble that virtual stages save: step time of 1F1B against interleaved 1F1B
(``pipeline_virtual_stages`` 2) at P = 2 and 4, same model, same microbatches.

With M microbatches on P ranks, 1F1B idles each rank for P - 1 forward + backward slots of a
stage: the bubble is (P - 1) / M of the ideal step. With V virtual stages per rank a slot is a
V-th as long, so the bubble is (P - 1) / (V x M), and a step takes (M + (P - 1) / V) / (M + P - 1)
of 1F1B's: the ``predicted_ratio`` written beside each measured one.

A GPT-2 of 8 layers (n_embd 64, 4 heads, vocabulary 256), batch 2 rows per microbatch x 32
tokens, fp32, dropout off, M = 8, AdamW. Two kinds of compute (``--compute``):

- ``sleep`` (default): every layer also sleeps ``--layer-ms`` in its forward and twice that in
  its backward. A sleeping rank leaves its core free, so ranks overlap as separate devices would
  even when the machine has fewer cores than ranks (or other jobs on them): the schedule's bubble
  shows as on a machine with a device per rank. The ideal step (no bubble) is
  M x 8 / P x 3 x layer-ms, written as ``ideal_s``; ``bubble_fraction`` = step / ideal - 1.
- ``real``: the tiny model's own CPU compute only. Meaningful with a core per rank and nothing
  else running; on a shared machine an idle rank's core goes to another rank, which hides the
  bubble, and the interleaved schedule's extra sends (V times as many) remain.

Every run is a separate job of fresh processes (gloo on CPU, one thread per rank); the
configurations run once in turn, ``--repeats`` times; ``spread`` gives min / median / max of
each step time and ratio over the repeats.

Usage: ``python bench/bench_pipeline_bubble.py [--compute sleep|real] [--pp 2 4] [--repeats 3]
[--steps 3] [--layer-ms 10]``; writes ``bench/results/pipeline_virtual.json`` (``--out`` for
another name).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common

LAYERS, MICROBATCHES, ROWS, SEQ, VOCAB = 8, 8, 2, 32, 256


class Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``ms`` and backward twice that: a layer's device time
    (a backward costs about two forwards)."""

    @staticmethod
    def forward(ctx, x, ms: float):
        ctx.ms = ms
        time.sleep(ms / 1000)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.ms / 1000)
        return grad, None


def _add_sleep(model, ms: float) -> None:
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (Sleep.apply(output[0], ms), *output[1:])
        return Sleep.apply(output, ms)
    for block in model.transformer.h:
        block.register_forward_hook(hook)


def rank_run(pp: int, virtual: int, compute: str, layer_ms: float, steps: int, warmup: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    import modelparallel as smp

    smp.init({"pipeline_parallel_degree": pp, "pipeline_virtual_stages": virtual, "microbatches": MICROBATCHES,
              "pipeline": "interleaved", "random_seed": 0})
    torch.manual_seed(0)
    full = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if compute == "sleep":
        _add_sleep(full, layer_ms)  # before the split: every rank's blocks keep their hook
    model = smp.DistributedModel(full)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(0, VOCAB, (ROWS * MICROBATCHES, SEQ), generator=torch.Generator().manual_seed(1))
    return common.smp_step_times(model, opt, ids, steps, warmup)


def predicted_ratio(pp: int, virtual: int) -> float:
    """Interleaved step over 1F1B step when only the bubble differs."""
    return (MICROBATCHES + (pp - 1) / virtual) / (MICROBATCHES + pp - 1)


def one_repeat(pps, compute, layer_ms, steps, warmup) -> dict:
    out = {}
    for pp in pps:
        step = {}
        for virtual in (1, 2):
            ranks = common.spawn(rank_run, pp, pp, virtual, compute, layer_ms, steps, warmup)
            step[virtual] = statistics.median(ranks[0]["times"])
        row = {"step_s_1f1b": step[1], "step_s_interleaved": step[2], "ratio": step[2] / step[1],
               "bubble_saved_s": step[1] - step[2]}
        if compute == "sleep":
            ideal = MICROBATCHES * LAYERS / pp * 3 * layer_ms / 1000
            row.update(ideal_s=ideal, bubble_fraction_1f1b=step[1] / ideal - 1,
                       bubble_fraction_interleaved=step[2] / ideal - 1)
        print(f"pp {pp}: 1F1B {step[1]:.3f} s, interleaved {step[2]:.3f} s, ratio {row['ratio']:.3f} "
              f"(predicted {predicted_ratio(pp, 2):.3f})", flush=True)
        out[f"pp{pp}"] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compute", choices=("sleep", "real"), default="sleep")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layer-ms", type=float, default=10.0)
    ap.add_argument("--out", default="pipeline_virtual")
    args = ap.parse_args()
    repeats = []
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}", flush=True)
        repeats.append(one_repeat(args.pp, args.compute, args.layer_ms, args.steps, args.warmup))
    keys = [k for k in repeats[0][f"pp{args.pp[0]}"] if k != "ideal_s"]
    spread = {f"pp{pp}": {k: common.spread(rep[f"pp{pp}"][k] for rep in repeats) for k in keys} for pp in args.pp}
    theory = {f"pp{pp}": {"bubble_fraction_1f1b": (pp - 1) / MICROBATCHES,
                          "bubble_fraction_interleaved": (pp - 1) / (2 * MICROBATCHES),
                          "predicted_ratio": predicted_ratio(pp, 2)} for pp in args.pp}
    result = {"device": "CPU, gloo, one thread per rank", "compute": args.compute, "layer_ms": args.layer_ms,
              "layers": LAYERS, "microbatches": MICROBATCHES, "virtual_stages": 2, "steps": args.steps,
              "theory": theory, "spread": spread, "repeats": repeats}
    for pp in args.pp:
        s = spread[f"pp{pp}"]["ratio"]
        print(f"pp {pp}: interleaved / 1F1B {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}), "
              f"predicted {theory[f'pp{pp}']['predicted_ratio']:.3f}")
    common.write_result(args.out, result)


if __name__ == "__main__":
    main()
