"""Checkpoint benchmark: partial save/load throughput against plain DCP, and full-export memory.

A GPT-2 of about 355M parameters (gpt2-medium's shape: n_embd 1024, 24 layers, 16 heads, the
50257-token vocabulary) with AdamW state, at TP=2 on two ranks (one thread each). Per repeat:

* ``ours save``: ``smp.save_checkpoint(partial=True)`` (DCP parts, checksums, fsync, atomic
  commit, ``newest``; no retention: old checkpoints are deleted outside the timings);
* ``dcp save``: ``torch.distributed.checkpoint.save`` of the same two state dicts (the model's
  ``state_dict()`` and ``get_optimizer_state_dict``), fsynced as DCP does by default;
* ``ours load``: ``smp.resume_from_checkpoint`` (checksum verification of every file first, key
  checks, then DCP's load with ``checkpoint/load/fastread.py``'s reader: same-layout chunks are read
  straight into the model's and optimizer's tensors);
* ``dcp load``: ``dcp.load`` of both + ``set_optimizer_state_dict``;
* the same two loads again after the files are dropped from the page cache (``cold_load``): what
  a job resuming after a restart reads.

Times are the slowest rank's; a warm-up round is not counted, the order of ours and DCP
alternates between repeats and medians are reported. The headline is the speed ratio (DCP's
time / ours for the same model state; DCP also writes the tied embedding twice); MB/s are each
one's bytes on disk over its time. Warm loads read from the page cache for both (each directory is
read once before: our save drops what it wrote from the cache). Then a full export
(``partial=False``) of the same model: peak RSS above the process's RSS just before it (VmHWM
reset through ``/proc/self/clear_refs``), compared with the largest tensor (target: <= 2x).

Usage: ``python bench/bench_checkpoint.py [--preset medium|small|tiny] [--repeats 4]``; starts its
two ranks with torchrun (``common.torchrun``) and writes ``bench/results/checkpoint.json``. Run it
on a quiet machine: the 1-minute load average after the run is recorded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import common

PRESETS = {"medium": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024),
           "small": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
           "tiny": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1001, n_positions=64)}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _timed(fn) -> float:
    """Seconds of ``fn()`` on the slowest rank (a collective), starting with nothing left for the
    disk to write: earlier runs' write-back and deletions would otherwise land in this timing."""
    import torch.distributed as dist

    os.sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    return common.slowest([time.perf_counter() - start])[0]


def _dcp_save(model, optimizer, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(model.module.state_dict(), checkpoint_id=directory / "model")
    dcp.save(get_optimizer_state_dict(model.module, optimizer.optimizer), checkpoint_id=directory / "optimizer")


def _dcp_load(model, optimizer, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    dcp.load(model.module.state_dict(), checkpoint_id=directory / "model")
    osd = get_optimizer_state_dict(model.module, optimizer.optimizer)
    dcp.load(osd, checkpoint_id=directory / "optimizer")
    set_optimizer_state_dict(model.module, optimizer.optimizer, osd)


def _build(preset: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import modelparallel as smp

    smp.init({"tensor_parallel_degree": 2, "random_seed": 0})
    cfg = GPT2Config(**PRESETS[preset], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = smp.DistributedModel(GPT2LMHeadModel(cfg))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.arange(16).reshape(1, 16)
    model.backward(model(ids, labels=ids).loss)  # one step: AdamW's exp_avg / exp_avg_sq exist
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _partial_runs(model, optimizer, work: Path, repeats: int) -> dict:
    import modelparallel as smp

    rows = {"ours_save": [], "dcp_save": [], "ours_load": [], "dcp_load": [], "ours_cold_load": [],
            "dcp_cold_load": []}
    sizes = {}
    for r in range(-1, repeats):  # round -1 warms up (first-call costs of both paths), not counted
        dcp_dir = work / f"dcp{r}"
        order = ("ours", "dcp") if r % 2 == 0 else ("dcp", "ours")
        for who in order:
            rows[f"{who}_save"].append(_timed(
                (lambda: smp.save_checkpoint(work / "ours", f"r{r}")) if who == "ours"
                else (lambda: _dcp_save(model, optimizer, dcp_dir))))
        sizes = {"ours": _dir_bytes(work / "ours" / f"r{r}_partial"), "dcp": _dir_bytes(dcp_dir)}
        for kind in ("load", "cold_load"):
            for who in order:
                if smp.rank() == 0:  # warm: both from the page cache; cold: both from disk
                    (common.evict if kind == "cold_load" else common.cache)(work / "ours" if who == "ours" else dcp_dir)
                rows[f"{who}_{kind}"].append(_timed(
                    (lambda: smp.resume_from_checkpoint(work / "ours")) if who == "ours"
                    else (lambda: _dcp_load(model, optimizer, dcp_dir))))
        if smp.rank() == 0:  # outside the timings: the baseline has no retention to compare with
            shutil.rmtree(dcp_dir)
            shutil.rmtree(work / "ours" / f"r{r}_partial")
        if r < 0:
            rows = {k: [] for k in rows}
    out = {"bytes": sizes, "seconds": rows}
    for kind, times in rows.items():
        who = kind.split("_")[0]
        out[f"{kind}_mb_s"] = sizes[who] / 1e6 / statistics.median(times)
    for op in ("save", "load", "cold_load"):  # same model state; DCP also writes the tied duplicate, so compare times
        out[f"{op}_speed_ratio"] = statistics.median(rows[f"dcp_{op}"]) / statistics.median(rows[f"ours_{op}"])
    return out


def _full_export(model, work: Path) -> dict:
    import modelparallel as smp

    largest = max(t.numel() * t.element_size() for t in model.module.state_dict().values())
    base = common.reset_peak()
    seconds = _timed(lambda: smp.save_checkpoint(work / "full", "export", partial=False))
    above = common.slowest([(common.status_mb("VmHWM") - base) * 2**20])[0]
    return {"seconds": seconds, "largest_tensor_bytes": largest, "peak_rss_above_baseline_bytes": above,
            "ratio_to_largest_tensor": above / largest, "bytes": _dir_bytes(work / "full" / "export")}


def worker(args) -> None:
    import torch.distributed as dist

    import modelparallel as smp

    common.one_thread()
    model, optimizer = _build(args.preset)
    # DTensor parameters report their global numel; tied weights are counted once
    result = {"preset": args.preset, "parameters": sum(p.numel() for p in model.module.parameters())}
    result["partial"] = _partial_runs(model, optimizer, Path(args.work), args.repeats)
    result["full_export"] = _full_export(model, Path(args.work))
    if smp.rank() == 0:
        common.report(result)
    dist.barrier()
    dist.destroy_process_group()


def run_in_scratch(script: str, parent: str | None, prefix: str, argv: list[str]) -> dict:
    """Rank 0's report of ``script --worker --work DIR *argv`` on 2 ranks, DIR a fresh directory
    (under ``parent``, default the temp dir) deleted afterwards."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        return common.torchrun(script, 2, ["--worker", "--work", str(work), *argv])[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def launch(args) -> dict:
    return run_in_scratch(__file__, args.dir, "bench-ckpt-", ["--preset", args.preset, "--repeats", str(args.repeats)])


def report(r: dict) -> None:
    p, f = r["partial"], r["full_export"]
    print(f"\nGPT-2 {r['preset']} ({r['parameters'] / 1e6:.0f}M parameters) + AdamW, TP=2, "
          f"{p['bytes']['ours'] / 1e9:.2f} GB per checkpoint")
    print(f"{'':10}{'ours s':>9}{'DCP s':>9}{'ours MB/s':>11}{'DCP MB/s':>10}{'speed vs DCP':>14}")
    for op in ("save", "load", "cold_load"):
        t_ours, t_dcp = (statistics.median(p["seconds"][f"{w}_{op}"]) for w in ("ours", "dcp"))
        print(f"{op:10}{t_ours:9.2f}{t_dcp:9.2f}{p[f'ours_{op}_mb_s']:11.0f}{p[f'dcp_{op}_mb_s']:10.0f}"
              f"{p[f'{op}_speed_ratio']:13.2f}x")
    print(f"(DCP writes {p['bytes']['dcp'] / 1e9:.2f} GB: it stores the tied embedding twice)")
    print(f"full export: {f['seconds']:.1f} s, peak RSS above baseline {f['peak_rss_above_baseline_bytes'] / 1e6:.0f} MB"
          f" = {f['ratio_to_largest_tensor']:.2f}x the largest tensor ({f['largest_tensor_bytes'] / 1e6:.0f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    ap.add_argument("--repeats", type=int, default=4, help="even: ours and DCP go first equally often")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/checkpoint.json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    result = launch(args)
    result["load_average_1min_after"] = common.load_average()[0]
    report(result)
    common.write_result("checkpoint", result, args.out)


if __name__ == "__main__":
    main()
