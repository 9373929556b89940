"""modelparallel against Hugging Face's own tensor parallelism, and TP=2 efficiency per architecture.

Part 1 (Llama, side by side): the same Llama checkpoint (hidden 1024, 4 layers, 16 heads,
intermediate 2816, vocab 8192), the same inputs (batch 4 x 256 tokens), fp32, one thread per
rank, TP=2: HF ``from_pretrained(path, tp_plan="auto")`` vs modelparallel (meta model +
shard-on-read ``load_hf_checkpoint``). Reported: median step time (forward + backward + AdamW)
and peak RSS above the post-import baseline, per rank, after every parameter was touched.

Part 2 (efficiency): each of the six architectures at a similar size, TP=1 (plain HF model, one
process, one thread) vs modelparallel TP=2: efficiency = t1 / (2 * t2).

``--baseline-ref REV`` adds a "before" column: the TP=2 runs are repeated, in the same run, with
the package imported from a ``git worktree`` of ``REV`` (the benchmark code stays this one), so
before/after come from one machine state. ``--quick`` shrinks every model (hidden 256, 2 layers,
vocab 2048, batch 2 x 128) for iteration; its results go to ``tp_vs_hf_quick.json``.

Usage: ``python bench/bench_tp_vs_hf.py [--steps 5] [--warmup 2] [--skip-archs] [--archs llama,gpt2]
[--quick] [--baseline-ref main]``; writes ``bench/results/tp_vs_hf.json``. Each measurement runs in
its own process(es), launched here; load averages are recorded before and after.
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


QUICK = dict(batch=2, seq=128, vocab=2048)
QUICK_SHAPE = {"hidden_size": 256, "n_embd": 256, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
               "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "num_key_value_heads": 4,
               "intermediate_size": 704, "attention_types": [[["global", "local"], 1]]}
"""The ``--quick`` sizes (hidden 256, 2 layers, 4 heads; Llama MLP 704, BERT's 1024 = 4 x hidden):
the same models, small enough to iterate on a busy machine."""


def shape_of(arch: str, quick: bool = False) -> dict:
    """Config keyword arguments of ``arch``'s benchmark model (the ``--quick`` one if asked)."""
    shape = dict(ARCHS[arch][2])
    if quick:
        shape = {k: QUICK_SHAPE.get(k, v) for k, v in shape.items()}
        if arch in ("bert", "roberta"):
            shape["intermediate_size"] = 4 * shape["hidden_size"]
    return shape


def sizes(quick: bool = False) -> tuple[int, int, int]:
    """(batch, sequence, vocabulary) of the benchmark."""
    return (QUICK["batch"], QUICK["seq"], QUICK["vocab"]) if quick else (BATCH, SEQ, VOCAB)


def build(arch: str, device: str = "cpu", quick: bool = False):
    import torch
    import transformers

    cfg_name, cls_name, _ = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(vocab_size=sizes(quick)[2], **shape_of(arch, quick), **NO_DROPOUT)
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, cls_name)(cfg)


def batch(quick: bool = False):
    import torch

    b, s, v = sizes(quick)
    return torch.randint(5, v, (b, s), generator=torch.Generator().manual_seed(0))


def timed_steps(model, warmup: int, steps: int, sync=lambda: None, quick: bool = False) -> list[float]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, times = batch(quick), []
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
        smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})  # same batch on both ranks, as TP=1 and HF
        with torch.device("meta"):
            model = smp.DistributedModel(build("llama", quick=args.quick))
        smp.load_hf_checkpoint(model, args.ckpt)
    elif args.method == "ours":
        smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})  # same batch on both ranks, as TP=1 and HF
        model = smp.DistributedModel(build(args.arch, quick=args.quick))
    else:
        model = build(args.arch, quick=args.quick)
    touch(model)
    loaded = rss_mb("VmHWM") - base
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    times = timed_steps(model, args.warmup, args.steps, sync, args.quick)
    rank = dist.get_rank() if dist.is_initialized() else 0
    row = dict(rank=rank, method=args.method, arch=args.arch, step_s=statistics.median(times), times=times,
               load_peak_mb=loaded, peak_mb=rss_mb("VmHWM") - base)
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(row))  # one file per rank: no interleaving


def command(script: str, nproc: int, extra: list[str]) -> list[str]:
    """``python script extra`` in one process, or under torchrun with ``nproc`` ranks."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                script] + extra
    return [sys.executable, script] + extra


def package_env(source: str = "") -> dict:
    """Environment of a worker: one thread, offline; ``source`` (a checkout) supplies ``modelparallel``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if source:
        env["PYTHONPATH"] = source
    return env


def baseline_checkout(ref: str) -> str:
    """A detached ``git worktree`` of ``ref`` (the "before" package), made once per run."""
    root = Path(__file__).resolve().parent.parent
    dest = Path(tempfile.mkdtemp(prefix="bench-baseline-")) / "src"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(dest), ref], check=True,
                   capture_output=True)
    return str(dest)


def drop_checkout(path: str) -> None:
    root = Path(__file__).resolve().parent.parent
    subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", path], capture_output=True)


def launch(method: str, arch: str, nproc: int, args, ckpt: str = "", source: str = "") -> list[dict]:
    result_dir = tempfile.mkdtemp(prefix="bench-tp-")
    extra = ["--worker", "--method", method, "--arch", arch, "--ckpt", ckpt, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--result-dir", result_dir] + (["--quick"] if args.quick else [])
    out = subprocess.run(command(__file__, nproc, extra), env=package_env(source), capture_output=True, text=True)
    rows = [json.loads(f.read_text()) for f in Path(result_dir).glob("rank*.json")]
    if out.returncode or len(rows) != nproc:
        raise RuntimeError(f"{method}/{arch} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    print(f"  {method:9s} {arch:8s} {'(before) ' if source else ''}step "
          f"{statistics.median(r['step_s'] for r in rows):.3f} s, peak {max(r['peak_mb'] for r in rows):.0f} MB, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    return sorted(rows, key=lambda r: r["rank"])


def llama_side_by_side(args, before: str = "") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        build("llama", quick=args.quick).save_pretrained(tmp)
        hf, ours = launch("hf_auto", "llama", 2, args, tmp), launch("ours_ckpt", "llama", 2, args, tmp)
        old = launch("ours_ckpt", "llama", 2, args, tmp, source=before) if before else None
    t_hf, t_ours = (max(r["step_s"] for r in rows) for rows in (hf, ours))
    out = dict(hf_tp_auto=hf, modelparallel=ours, step_ratio_ours_over_hf=t_ours / t_hf,
               peak_ratio_ours_over_hf=max(r["peak_mb"] for r in ours) / max(r["peak_mb"] for r in hf))
    if old:
        out.update(before=old, step_ratio_before_over_hf=max(r["step_s"] for r in old) / t_hf,
                   peak_ratio_before_over_hf=max(r["peak_mb"] for r in old) / max(r["peak_mb"] for r in hf))
    return out


def efficiency(args, before: str = "") -> dict:
    out = {}
    for arch in args.archs:
        t1 = launch("hf", arch, 1, args)[0]["step_s"]
        t2 = max(r["step_s"] for r in launch("ours", arch, 2, args))
        out[arch] = dict(tp1_hf_s=t1, tp2_s=t2, speedup=t1 / t2, efficiency=t1 / (2 * t2))
        if before:
            t0 = max(r["step_s"] for r in launch("ours", arch, 2, args, source=before))
            out[arch].update(tp2_before_s=t0, efficiency_before=t1 / (2 * t0))
    return out


def print_tables(result: dict) -> None:
    """The README's tables (markdown)."""
    r = result["llama"]
    print(f"Llama TP=2, ours / HF tp_plan=auto: step time {r['step_ratio_ours_over_hf']:.3f}x, "
          f"peak RSS {r['peak_ratio_ours_over_hf']:.3f}x"
          + (f" (before: {r['step_ratio_before_over_hf']:.3f}x, {r['peak_ratio_before_over_hf']:.3f}x)"
             if "before" in r else ""))
    eff = result.get("efficiency", {})
    if not eff:
        return
    before = any("tp2_before_s" in e for e in eff.values())
    print("\n| arch | TP=1 HF, s | " + ("TP=2 before, s | efficiency before | " if before else "")
          + "TP=2 ours, s | efficiency |")
    print("|---|---|" + ("---|---|" if before else "") + "---|---|")
    for arch, e in eff.items():
        old = f"{e['tp2_before_s']:.3f} | {e['efficiency_before']:.3f} | " if before else ""
        print(f"| {arch} | {e['tp1_hf_s']:.3f} | {old}{e['tp2_s']:.3f} | {e['efficiency']:.3f} |")
    print(f"\nload average at start {result['load_average_at_start']}, at end {result['load_average_at_end']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-archs", action="store_true", help="only the Llama side-by-side run")
    ap.add_argument("--archs", default=",".join(ARCHS), help="comma-separated architectures for the efficiency table")
    ap.add_argument("--quick", action="store_true", help="small models (see QUICK), for iteration")
    ap.add_argument("--baseline-ref", default="", help="git revision whose package gives the 'before' column")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="", help=argparse.SUPPRESS)
    ap.add_argument("--arch", default="llama", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch

    args.archs = [a for a in args.archs.split(",") if a]
    unknown = sorted(set(args.archs) - set(ARCHS))
    if unknown:
        ap.error(f"unknown architectures {unknown}; known: {', '.join(ARCHS)}")
    b, s, v = sizes(args.quick)
    result = dict(torch=torch.__version__, cores=os.cpu_count(), batch=b, seq=s, vocab=v, quick=args.quick,
                  baseline_ref=args.baseline_ref, load_average_at_start=list(os.getloadavg()))
    before = baseline_checkout(args.baseline_ref) if args.baseline_ref else ""
    try:
        result["llama"] = llama_side_by_side(args, before)
        if not args.skip_archs:
            result["efficiency"] = efficiency(args, before)
    finally:
        if before:
            drop_checkout(before)
    result["load_average_at_end"] = list(os.getloadavg())
    out = RESULTS.with_name("tp_vs_hf_quick.json") if args.quick else RESULTS
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
