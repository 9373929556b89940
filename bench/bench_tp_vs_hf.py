"""modelparallel against Hugging Face's own tensor parallelism, and TP=2 efficiency per architecture.

Part 1 (Llama, side by side): the same Llama checkpoint (hidden 1024, 4 layers, 16 heads,
intermediate 2816, vocab 8192), the same inputs (batch 4 x 256 tokens), fp32, one thread per
rank, TP=2: HF ``from_pretrained(path, tp_plan="auto")`` vs modelparallel (meta model +
shard-on-read ``load_hf_checkpoint``). Reported: median step time (forward + backward + AdamW)
and peak RSS above the post-import baseline, per rank, after every parameter was touched.

Part 2 (efficiency): each of the six architectures at a similar size, TP=1 (plain HF model, one
process, one thread) vs modelparallel TP=2: efficiency = t1 / (2 * t2).

Usage: ``python bench/bench_tp_vs_hf.py [--steps 5] [--warmup 2] [--skip-archs]``; writes
``bench/results/tp_vs_hf.json``. Each measurement runs in its own process(es), launched here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "tp_vs_hf.json"
BATCH, SEQ, VOCAB = 4, 256, 8192
ARCHS = {  # similar sizes: hidden 1024, 4 layers, 16 heads, MLP 2816 or 4096
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                                      num_key_value_heads=16, intermediate_size=2816)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=1024, n_layer=4, n_head=16, n_positions=512)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=1024, n_layer=4, n_head=16, rotary_dim=64, n_positions=512)),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(hidden_size=1024, num_layers=4, num_heads=16,
                                                          attention_types=[[["global", "local"], 2]],
                                                          max_position_embeddings=512)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                                   intermediate_size=4096)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(hidden_size=1024, num_hidden_layers=4,
                                                           num_attention_heads=16, intermediate_size=4096)),
}
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)


def rss_mb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build(arch: str, device: str = "cpu"):
    import torch
    import transformers

    cfg_name, cls_name, shape = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(vocab_size=VOCAB, **shape, **NO_DROPOUT)
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, cls_name)(cfg)


def batch():
    import torch

    return torch.randint(5, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def timed_steps(model, warmup: int, steps: int, sync=lambda: None) -> list[float]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, times = batch(), []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def touch(model) -> None:
    """In-place op on every local shard, so mmapped weights count in RSS (FACTS.md)."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).mul_(1.0)


def worker(args) -> None:
    """One rank of one measurement; prints a JSON line."""
    import torch
    import torch.distributed as dist
    import transformers

    import modelparallel as smp

    torch.set_num_threads(1)
    base = rss_mb()
    if args.method == "hf_auto":
        model = transformers.AutoModelForCausalLM.from_pretrained(args.ckpt, tp_plan="auto")
    elif args.method == "ours_ckpt":
        smp.init({"tensor_parallel_degree": 2})
        with torch.device("meta"):
            model = smp.DistributedModel(build("llama"))
        smp.load_hf_checkpoint(model, args.ckpt)
    elif args.method == "ours":
        smp.init({"tensor_parallel_degree": 2})
        model = smp.DistributedModel(build(args.arch))
    else:
        model = build(args.arch)
    touch(model)
    loaded = rss_mb("VmHWM") - base
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    times = timed_steps(model, args.warmup, args.steps, sync)
    rank = dist.get_rank() if dist.is_initialized() else 0
    row = dict(rank=rank, method=args.method, arch=args.arch, step_s=statistics.median(times), times=times,
               load_peak_mb=loaded, peak_mb=rss_mb("VmHWM") - base)
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(row))  # one file per rank: no interleaving


def launch(method: str, arch: str, nproc: int, args, ckpt: str = "") -> list[dict]:
    result_dir = tempfile.mkdtemp(prefix="bench-tp-")
    cmd = [sys.executable, __file__, "--worker", "--method", method, "--arch", arch, "--ckpt", ckpt,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--result-dir", result_dir]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + cmd[1:]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(f.read_text()) for f in Path(result_dir).glob("rank*.json")]
    if out.returncode or len(rows) != nproc:
        raise RuntimeError(f"{method}/{arch} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    print(f"  {method:9s} {arch:8s} step {statistics.median(r['step_s'] for r in rows):.3f} s, "
          f"peak {max(r['peak_mb'] for r in rows):.0f} MB", flush=True)
    return sorted(rows, key=lambda r: r["rank"])


def llama_side_by_side(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        build("llama").save_pretrained(tmp)
        hf, ours = launch("hf_auto", "llama", 2, args, tmp), launch("ours_ckpt", "llama", 2, args, tmp)
    t_hf, t_ours = (max(r["step_s"] for r in rows) for rows in (hf, ours))
    return dict(hf_tp_auto=hf, modelparallel=ours, step_ratio_ours_over_hf=t_ours / t_hf,
                peak_ratio_ours_over_hf=max(r["peak_mb"] for r in ours) / max(r["peak_mb"] for r in hf))


def efficiency(args) -> dict:
    out = {}
    for arch in ARCHS:
        t1 = launch("hf", arch, 1, args)[0]["step_s"]
        t2 = max(r["step_s"] for r in launch("ours", arch, 2, args))
        out[arch] = dict(tp1_hf_s=t1, tp2_s=t2, speedup=t1 / t2, efficiency=t1 / (2 * t2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-archs", action="store_true", help="only the Llama side-by-side run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="", help=argparse.SUPPRESS)
    ap.add_argument("--arch", default="llama", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch

    result = dict(torch=torch.__version__, cores=os.cpu_count(), batch=BATCH, seq=SEQ, vocab=VOCAB,
                  llama=llama_side_by_side(args))
    if not args.skip_archs:
        result["efficiency"] = efficiency(args)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    r = result["llama"]
    print(f"Llama TP=2, ours / HF tp_plan=auto: step time {r['step_ratio_ours_over_hf']:.3f}x, "
          f"peak RSS {r['peak_ratio_ours_over_hf']:.3f}x")
    for arch, e in result.get("efficiency", {}).items():
        print(f"{arch:8s} TP=1 {e['tp1_hf_s']:.3f} s  TP=2 {e['tp2_s']:.3f} s  efficiency {e['efficiency']:.3f}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
