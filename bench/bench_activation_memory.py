"""Activation memory of a tiny GPT-2 at TP=2: plain, activation-checkpointed, checkpointed + offloaded.

For each variant one job of 2 ranks (``common.spawn``, one thread each) builds the same GPT-2 (n_embd 256,
6 layers, 8 heads, vocabulary 8192, batch 4 x 256 tokens, fp32, dropout off) as a
``smp.DistributedModel`` and runs forward + backward steps. Per rank it reports:

- ``saved_mb``: bytes autograd keeps for backward at the end of the forward, counted exactly by a
  ``torch.autograd.graph.saved_tensors_hooks`` around the forward (each storage once; parameters
  excluded: they are not activations). Deterministic: it does not depend on the allocator.
- ``offloaded_mb``: of those, the bytes the activation offloader holds (on a GPU they sit in host
  memory instead of device memory; on this CPU-only machine host and device are the same memory,
  so offloading cannot lower RSS here: the code path runs, nothing moves).
- ``kept_for_device_mb``: ``saved_mb`` minus ``offloaded_mb``, what stays in device memory on a GPU.
- ``peak_rss_mb`` / ``rss_rise_mb``: the process's VmHWM, and its rise over the RSS measured just
  before the first step (allocator-dependent, hence the separate processes).
- ``step_s``: median step time (recomputation costs about one extra forward of the layers).

Usage: ``python bench/bench_activation_memory.py [--steps 3]``; writes
``bench/results/activation_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import common

SHAPE = dict(n_embd=256, n_layer=6, n_head=8, vocab_size=8192, n_positions=256)
BATCH, SEQ, SEED = 4, 256, 0
VARIANTS = {
    "plain": {},
    "checkpointed": {"checkpoint": True},
    "checkpointed_offloaded": {"checkpoint": True, "offload_activations": True},
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


def run_worker(variant: str, steps: int) -> dict:
    """One rank of one variant: its measurements."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import modelparallel as smp
    from modelparallel.activations import job_offloader

    opts = VARIANTS[variant]
    smp.init({"tensor_parallel_degree": 2, "random_seed": SEED,
              "offload_activations": opts.get("offload_activations", False)})
    torch.manual_seed(SEED)
    model = smp.DistributedModel(GPT2LMHeadModel(GPT2Config(**SHAPE, resid_pdrop=0.0, embd_pdrop=0.0,
                                                             attn_pdrop=0.0)))
    if opts.get("checkpoint"):
        smp.set_activation_checkpointing(model.module.transformer.h)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    offloader = job_offloader()
    rss_before = common.status_mb("VmRSS")
    times, saved, offloaded, losses = [], 0, 0, []
    for step in range(steps):
        start = time.perf_counter()
        hooks, seen = saved_bytes_counter(model)
        with hooks:
            loss = model(ids, labels=ids).loss
        if step == 0:
            saved = sum(seen.values())
            offloaded = offloader.stored_bytes() if offloader is not None else 0
        model.backward(loss)
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    # the offloader's hooks take the region inputs before the counting hooks see them: add them back
    mine = {"saved_mb": (saved + offloaded) / 2**20, "offloaded_mb": offloaded / 2**20,
            "kept_for_device_mb": saved / 2**20,
            "peak_rss_mb": common.status_mb("VmHWM"), "rss_rise_mb": common.status_mb("VmHWM") - rss_before,
            "step_s": statistics.median(times), "first_loss": losses[0]}
    return mine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out = {"shape": SHAPE, "batch": BATCH, "seq": SEQ, "tp": 2, "steps": args.steps,
           "load_average_at_start": common.load_average(), "variants": {}}
    for variant in VARIANTS:
        out["variants"][variant] = {"ranks": common.spawn(run_worker, 2, variant, args.steps),
                                    "load_average_1min_after": common.load_average()[0]}
        print(variant, json.dumps(out["variants"][variant]), flush=True)
    plain = out["variants"]["plain"]["ranks"][0]
    for variant, res in out["variants"].items():
        r0 = res["ranks"][0]
        res["saved_ratio_vs_plain"] = r0["saved_mb"] / plain["saved_mb"]
        res["kept_for_device_ratio_vs_plain"] = r0["kept_for_device_mb"] / plain["kept_for_device_mb"]
        res["step_time_ratio_vs_plain"] = r0["step_s"] / plain["step_s"]
        res["first_loss_abs_diff_vs_plain"] = abs(r0["first_loss"] - plain["first_loss"])
    common.write_result("activation_memory", out)
    print(json.dumps({v: {k: r[k] for k in r if k != "ranks"} for v, r in out["variants"].items()}, indent=2))


if __name__ == "__main__":
    main()
