"""One device: training throughput, model FLOPs utilization and peak memory of this library against
plain PyTorch with the same numerics, and checkpoint save / resume times against DCP.

Variants (each in its own process, so peak memory is its own; world size 1):

- ``plain-v1``: bf16 weights, fp32 master copies that AdamW updates, the bf16 weights copied back
  after each step: the numerics of ``smp.DistributedModel`` + ``@smp.step`` with ``"bf16": true``.
- ``ours-v1``: ``smp.delay_param_initialization`` (built on meta, initialized on the device) +
  ``smp.DistributedModel`` + ``smp.DistributedOptimizer`` + ``@smp.step``, config ``bf16``.
- ``plain-fsdp2``: the HF model under ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``: fp32 weights (the masters) gathered in bf16 for compute.
- ``ours-v2``: the same FSDP2 calls over ``smp.transform``'s output (a SageMaker v2 script).
- ``ckpt-ours`` / ``ckpt-dcp``: the ``ours-v1`` / ``plain-v1`` model and AdamW state (bf16 weights,
  fp32 masters, two fp32 moments) saved synchronously, asynchronously (time the call blocks
  training; the first save allocates staging memory, later ones reuse it) and loaded back:
  ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` against ``torch.distributed.checkpoint``'s
  ``save`` / ``async_save`` / ``load``, into the same directory kind (``--ckpt-dir``).

Model FLOPs per token: 6 x (parameters outside the input embedding) + 12 x layers x hidden x seq
(attention scores and values, forward and backward, counted over the whole square as PaLM's
appendix does). MFU divides by the device's dense bf16 peak (``PEAK_TFLOPS`` by device name, or
``--peak-tflops``); none on CPU unless given.

Usage on a GPU (Llama ~1B): ``python bench/bench_gpu.py --layers 16 --hidden 2048 --seq 2048 --batch 4``.
Tiny, on CPU: ``python bench/bench_gpu.py --device cpu --layers 2 --hidden 64 --seq 32 --batch 2 --steps 2
--repeats 2 --vocab 512``. Writes ``bench/results/gpu_<device>.json`` (``--out`` to choose).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import gpu_variants

VARIANTS = ("plain-v1", "ours-v1", "plain-fsdp2", "ours-v2", "ckpt-dcp", "ckpt-ours")
NUMERICS = {
    "plain-v1": "bf16 weights; AdamW on fp32 master copies; bf16 weights copied back after each step",
    "ours-v1": "smp.DistributedModel, config bf16: bf16 weights, fp32 masters in smp.DistributedOptimizer",
    "plain-fsdp2": "FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 weights",
    "ours-v2": "the same FSDP2 policy over smp.transform's output",
    "ckpt-dcp": "plain-v1's bf16 weights, fp32 masters and AdamW moments through torch.distributed.checkpoint",
    "ckpt-ours": "ours-v1's model and optimizer through smp.save_checkpoint / smp.resume_from_checkpoint",
}
"""What each variant computes in which precision (each "ours" against the "plain" with the same)."""
PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
               "A10G": 125.0, "L4": 121.0}
"""Dense bf16 tensor-core peaks (vendor data sheets, without sparsity), by a part of the device
name; the first match wins, so the more specific names come first."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 64)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads / 4, at least 1)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 4 x hidden)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--saves", type=int, default=3, help="asynchronous saves (the first allocates staging)")
    p.add_argument("--adamw", choices=("for-loop", "foreach", "fused"), default="for-loop",
                   help="AdamW implementation, the same for every variant (default: %(default)s)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--ckpt-dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.heads = args.heads or max(1, args.hidden // 64)
    args.kv_heads = args.kv_heads or max(1, args.heads // 4)
    args.intermediate = args.intermediate or 4 * args.hidden
    return args


def _child_env(args) -> dict:
    env = {**os.environ, "MODELPARALLEL_DEVICE": args.device, "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    return env


def run_variant(variant: str, argv: list[str], args) -> dict:
    """Run one variant in a fresh process; its record."""
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        out = Path(tmp, "record.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", variant, "--child-out", str(out)]
        proc = subprocess.run(cmd, env=_child_env(args), capture_output=True, text=True)
        if proc.returncode:
            tail = (proc.stdout[-1500:] + proc.stderr[-3000:]).strip()
            return {"variant": variant, "error": tail.splitlines()[-1] if tail else f"exit {proc.returncode}",
                    "log_tail": tail}
        return json.loads(out.read_text())


def peak_tflops(args, device_name: str) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    for part, value in PEAK_TFLOPS.items():
        if part in device_name:
            return value, f"data-sheet dense bf16 peak of {part}"
    return None, "unknown device: pass --peak-tflops"


def summarize(records: list[dict], args) -> dict:
    """MFU and ratios from the variants' records."""
    first = next((r for r in records if "device_name" in r), {})
    peak, peak_source = peak_tflops(args, first.get("device_name", ""))
    for r in records:
        if "tokens_per_s" in r:
            r["model_tflops_per_s"] = {k: v * r["flops_per_token"] / 1e12 for k, v in r["tokens_per_s"].items()
                                       if k != "values"}
            r["mfu"] = ({k: v / peak for k, v in r["model_tflops_per_s"].items()} if peak else None)
    by = {r["variant"]: r for r in records}
    ratios = {}
    for ours, plain in (("ours-v1", "plain-v1"), ("ours-v2", "plain-fsdp2")):
        if "tokens_per_s" in by.get(ours, {}) and "tokens_per_s" in by.get(plain, {}):
            ratios[f"{ours} / {plain} tokens/s (median)"] = (by[ours]["tokens_per_s"]["median"]
                                                             / by[plain]["tokens_per_s"]["median"])
            ratios[f"{ours} / {plain} peak memory"] = by[ours]["peak_memory_gib"] / by[plain]["peak_memory_gib"]
    return {"peak_tflops": peak, "peak_source": peak_source, "ratios": ratios}


def table(records: list[dict]) -> str:
    lines = ["| variant | tokens/s (median, min-max) | MFU | peak GiB | checkpoint |", "|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} | | | |")
            continue
        tps = r.get("tokens_per_s")
        speed = f"{tps['median']:,.0f} ({tps['min']:,.0f}-{tps['max']:,.0f})" if tps else ""
        mfu = f"{r['mfu']['median']:.1%}" if r.get("mfu") else ""
        ck = r.get("checkpoint")
        ckpt = (f"sync {ck['sync_save_s']:.2f} s, async blocked {ck['async_blocked_s'][0]:.2f} s first / "
                f"{statistics.median(ck['async_blocked_s'][1:] or [float('nan')]):.2f} s later, "
                + (f"next step {max(ck['step_after_async_save_s']):.2f} s at most (alone {ck['step_s']:.2f} s), "
                   if "step_s" in ck else "") +
                f"resume {ck['resume_s']:.2f} s cached / {ck.get('resume_cold_s', float('nan')):.2f} s from disk, "
                f"{ck['bytes'] / 2**30:.2f} GiB") if ck else ""
        lines.append(f"| {r['variant']} | {speed} | {mfu} | {r.get('peak_memory_gib', 0):.2f} | {ckpt} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        record = gpu_variants.run(args)
        Path(args.child_out).write_text(json.dumps(record))
        return 0
    own_dir = args.ckpt_dir is None
    if own_dir:
        args.ckpt_dir = tempfile.mkdtemp(prefix="bench-gpu-ckpt-")
        argv += ["--ckpt-dir", args.ckpt_dir]
    try:
        records = []
        for variant in args.variants:
            start = time.perf_counter()
            records.append(run_variant(variant, argv, args))
            print(f"{variant}: {time.perf_counter() - start:.0f} s"
                  + (f" FAILED: {records[-1]['error']}" if "error" in records[-1] else ""), flush=True)
            print(json.dumps(records[-1]), flush=True)  # a record survives a later variant's time-out
    finally:
        if own_dir:
            shutil.rmtree(args.ckpt_dir, ignore_errors=True)
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "seq",
                                           "batch", "steps", "warmup", "repeats", "saves", "adamw")}
    result = {"shape": shape, "numerics": {v: NUMERICS[v] for v in args.variants}, **summarize(records, args),
              "variants": records}
    print(table(records))
    name = f"gpu_{args.device}"
    common.write_result(name, result, args.out)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
