"""Composed layouts against their parts: the step time of one global batch at every layout of 4
(and with ``--eight``, 8) ranks, each against pure data parallelism at the same world size and
against one process.

A GPT-2 (n_embd 256, 4 layers, 8 heads, vocabulary 512, dropout off), global batch 8 x 256, fp32,
AdamW, v1's API (``DistributedModel`` + ``@smp.step``); at pipeline degree 2, 4 microbatches
(1F1B). Each data-parallel rank takes its rows of the global batch, each context-parallel rank
its part of them (``smp.get_batch_for_cp_rank``), so every layout computes the same step. A
step's time is the slowest rank's; per layout the median over ``--steps`` steps after
``--warmup``. Every layout is run ``--repeats`` times (all layouts once, then again); ``spread``
gives min / median / max over the repeats of the step time and of the ratios.

What it shows: the cost each dimension's communication adds when dimensions are composed, against
the cost of each alone (``vs_dp``: step time over the pure data-parallel layout's at the same
world size; below 1 is faster). On a CPU machine with fewer cores than ranks (one thread per rank)
the ranks share cores: absolute times and scaling against one process are not a GPU's, the
ratios between layouts of one world size are what carries over in kind.

Usage: ``python bench/bench_composition.py [--steps 3] [--warmup 1] [--repeats 3] [--eight]``;
writes ``bench/results/composition.json``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import common
import modelparallel as smp

BATCH, SEQ, VOCAB = 8, 256, 512

LAYOUTS = {  # name: (ranks, tp, pp, cp); data parallel is the rest
    "one process": (1, 1, 1, 1),
    "dp4": (4, 1, 1, 1), "tp2 x dp2": (4, 2, 1, 1), "pp2 x dp2": (4, 1, 2, 1), "cp2 x dp2": (4, 1, 1, 2),
    "pp2 x tp2": (4, 2, 2, 1), "tp2 x cp2": (4, 2, 1, 2), "pp2 x cp2": (4, 1, 2, 2),
}
EIGHT = {
    "dp8": (8, 1, 1, 1), "pp2 x tp2 x dp2": (8, 2, 2, 1), "tp2 x cp2 x dp2": (8, 2, 1, 2),
    "pp2 x cp2 x tp2": (8, 2, 2, 2),
}


def build() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=8, n_positions=SEQ, vocab_size=VOCAB,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                      eos_token_id=2))


def rank_run(tp: int, pp: int, cp: int, steps: int, warmup: int) -> dict:
    smp.init({"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "context_parallel_degree": cp,
              "microbatches": 4 if pp > 1 else 1, "pipeline": "interleaved", "random_seed": 0})
    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = BATCH // smp.rdp_size()
    mine = ids[smp.rdp_rank() * rows:(smp.rdp_rank() + 1) * rows]
    if cp > 1:
        mine = smp.get_batch_for_cp_rank(mine)
    return common.smp_step_times(model, opt, mine, steps, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eight", action="store_true", help="also the 8-rank layouts")
    args = ap.parse_args()
    layouts = {**LAYOUTS, **(EIGHT if args.eight else {})}
    repeats = []
    for r in range(args.repeats):
        one = {}
        for name, (ranks, tp, pp, cp) in layouts.items():
            result = common.spawn(rank_run, ranks, tp, pp, cp, args.steps, args.warmup)
            one[name] = {"ranks": ranks, "tp": tp, "pp": pp, "cp": cp, "dp": ranks // (tp * pp * cp),
                         "median_step_s": statistics.median(result[0]["times"]), "load": result[0]["load"]}
            print(f"repeat {r + 1}/{args.repeats} {name}: {one[name]['median_step_s']:.3f} s/step", flush=True)
        for name, rec in one.items():
            dp_name = f"dp{rec['ranks']}"
            if dp_name in one:
                rec["vs_dp"] = rec["median_step_s"] / one[dp_name]["median_step_s"]
            rec["vs_one_process"] = rec["median_step_s"] / one["one process"]["median_step_s"]
        repeats.append(one)
    metrics = ("median_step_s", "vs_dp", "vs_one_process")
    spread = {name: {m: common.spread(rep[name][m] for rep in repeats) for m in metrics if m in repeats[0][name]}
              for name in layouts}
    for name, of in spread.items():
        print(name, ", ".join(f"{m} {v['median']:.3g} ({v['min']:.3g}-{v['max']:.3g})" for m, v in of.items()))
    path = common.write_result("composition", {"batch": BATCH, "seq": SEQ, "device": "cpu (gloo, one thread per rank)",
                                                "repeats": repeats, "spread": spread})
    print(f"written {path}")


if __name__ == "__main__":
    main()
