"""Context parallelism and sequence parallelism on a small Llama at long sequences, one thread per rank.

Context parallelism (C = 1, 2, and 4 for memory only: 4 single-threaded ranks on a 2-core machine
share the cores, so their times say nothing) with both communication types, and sequence
parallelism at TP = 2 against TP = 2 alone. Each variant is one job (``common.spawn``) building the
same Llama (hidden 256, 2 layers, 4 heads of 64, 2 key/value heads, intermediate 512, vocabulary
1024, fp32) and running forward + backward + AdamW on one sequence of ``--seq`` tokens (every
context rank its part of it). Per rank:

- ``saved_mb``: bytes autograd keeps for backward at the end of the forward (saved-tensor hooks,
  each storage once, parameters excluded): the activation memory, independent of the allocator.
- ``peak_rise_mb``: the rise of the peak resident size over the resident size before the step
  (``VmHWM`` restarted before the timed steps): activations plus the step's transient buffers.
- ``step_s``: median step time; a step ends when its slowest rank ends.
- ``loss``: the first step's loss (the mean of the context ranks' shares): equal across variants.

C = 1 is Hugging Face's own model (``sdpa`` attention, PyTorch's fused CPU kernel), one process.
Ratios are against it (context parallelism) or against TP = 2 alone (sequence parallelism).

Every variant is run ``--repeats`` times in turn; ``spread`` gives the min / median / max of each
ratio over the repeats, ``summary`` and ``variants`` are the last repeat's.

Usage: ``python bench/bench_context_parallel.py [--seq 8192] [--steps 3] [--warmup 1] [--repeats 3]
[--only V ...] [--merge]``; writes ``bench/results/context_parallel.json`` (``--merge`` keeps the variants measured
earlier with the same settings, so a run can be split into parts). Needs a quiet machine: the load
averages are recorded, at the start of the run and after each variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import common

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1024)
SEED = 0
VARIANTS = {  # name -> (ranks, config, cp_comm_type, timed)
    "c1": (1, {}, "p2p", True),
    "c2_p2p": (2, {"context_parallel_degree": 2}, "p2p", True),
    "c2_all_gather": (2, {"context_parallel_degree": 2}, "all_gather", True),
    "c4_p2p": (4, {"context_parallel_degree": 4}, "p2p", False),
    "tp2": (2, {"tensor_parallel_degree": 2}, "p2p", True),
    "tp2_sp": (2, {"tensor_parallel_degree": 2, "sequence_parallel": True}, "p2p", True),
}


def saved_bytes_counter(model):
    """A saved-tensor hooks context and a dict filled with the bytes saved (each storage once)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t
    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def _step(model, optimizer, ids, count: bool):
    hooks, seen = saved_bytes_counter(model)
    with hooks:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), sum(seen.values()) if count else 0


def run_worker(variant: str, seq: int, steps: int, warmup: int) -> dict:
    """One rank of one variant: its measurements."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import modelparallel as smp

    ranks, config, comm, _ = VARIANTS[variant]
    smp.init({"random_seed": SEED, "prescaled_batch": True, **config})
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, max_position_embeddings=seq))
    model = smp.transform(model, cp_comm_type=comm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = smp.get_batch_for_cp_rank(torch.randint(0, SHAPE["vocab_size"], (1, seq),
                                                  generator=torch.Generator().manual_seed(SEED)))
    loss, saved = _step(model, optimizer, ids, count=True)
    for _ in range(warmup - 1):
        _step(model, optimizer, ids, count=False)
    before = common.reset_peak()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        _step(model, optimizer, ids, count=False)
        times.append(time.perf_counter() - start)
    dist.all_reduce(loss, group=smp.get_cp_process_group())
    return {"saved_mb": saved / 2**20, "peak_rise_mb": common.status_mb("VmHWM") - before,
            "step_s": statistics.median(common.slowest(times)), "loss": loss.item() / smp.cp_size()}


def _summary(out: dict) -> dict:
    rows = {}
    for name, res in out["variants"].items():
        base = out["variants"]["tp2" if name.startswith("tp2") else "c1"]["ranks"][0]
        r0 = res["ranks"][0]
        timed = VARIANTS[name][3]
        rows[name] = {"saved_mb": round(r0["saved_mb"], 1), "peak_rise_mb": round(r0["peak_rise_mb"], 1),
                      "step_s": round(r0["step_s"], 3) if timed else None,
                      "saved_ratio": round(r0["saved_mb"] / base["saved_mb"], 3),
                      "peak_rise_ratio": round(r0["peak_rise_mb"] / base["peak_rise_mb"], 3),
                      "step_time_ratio": round(r0["step_s"] / base["step_s"], 3) if timed else None,
                      "loss": r0["loss"], "load_1min_before": res.get("load_average_1min_before"),
                      "load_1min_after": res["load_average_1min_after"]}
    return rows


def _earlier_variants(out: dict) -> dict:
    """The variants of the results file measured with the same settings as ``out`` (a run in parts
    keeps each part short); a file with other settings contributes nothing."""
    path = common.RESULTS_DIR / "context_parallel.json"
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    same = all(earlier.get(key) == out[key] for key in ("shape", "seq", "steps", "warmup"))
    return dict(earlier["variants"]) if same else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="every variant of --only, this many times in turn")
    parser.add_argument("--only", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--merge", action="store_true",
                        help="keep the variants already in the results file (same shape, --seq, "
                             "--steps, --warmup) and replace only those run now")
    args = parser.parse_args()
    out = {"shape": SHAPE, "seq": args.seq, "batch": 1, "steps": args.steps, "warmup": args.warmup,
           "threads_per_rank": 1, "load_average_at_start": common.load_average(), "variants": {}}
    if args.merge:
        out["variants"] = _earlier_variants(out)
    summaries = []
    for r in range(args.repeats):
        for variant in args.only:
            ranks = VARIANTS[variant][0]
            before = common.load_average()[0]
            out["variants"][variant] = {"load_average_1min_before": before,
                                        "ranks": common.spawn(run_worker, ranks, variant, args.seq, args.steps,
                                                              args.warmup),
                                        "load_average_1min_after": common.load_average()[0]}
            print(f"repeat {r + 1}/{args.repeats}", variant, json.dumps(out["variants"][variant]), flush=True)
        if {"c1", "tp2"} <= set(out["variants"]):
            summaries.append(_summary(out))
    if summaries:
        out["summary"] = summaries[-1]
        out["repeats"] = len(summaries)
        out["spread"] = {name: {m: common.spread(s[name][m] for s in summaries)
                                for m in ("step_time_ratio", "saved_ratio", "peak_rise_ratio") if row[m] is not None}
                         for name, row in summaries[-1].items()}
        print(json.dumps(out["summary"], indent=2))
        for name, metrics in out["spread"].items():
            print(name, ", ".join(f"{m} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for m, v in metrics.items()))
    common.write_result("context_parallel", out)


if __name__ == "__main__":
    main()
