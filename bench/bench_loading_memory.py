"""Peak memory per rank (and time) to get a pretrained Llama ready to train at TP=2, four ways.

A Llama of about 1.7 GB in fp32 (hidden 2048, 6 layers, vocabulary 32000, untied head) is saved
as one safetensors file in a temporary directory. Each method then runs in its own
``torchrun --nproc-per-node 2`` job:

* ``naive``: ``from_pretrained`` on every rank (touched, as moving it to a device would), then
  ``smp.DistributedModel`` (the usual recipe);
* ``hf_tp_auto``: Hugging Face's own ``from_pretrained(..., tp_plan="auto")``;
* ``sagemaker_v2``: SageMaker v2's recipe: rank 0 ``from_pretrained(low_cpu_mem_usage=True)``,
  the others build the model under ``accelerate.init_empty_weights()``, then
  ``smp.transform(model, load_state_dict_from_rank0=True)``;
* ``v2_recipe_b``: SageMaker v2's whole large-model recipe as its page writes it: the above,
  then ``DelayedParamIniter`` on ranks != 0 (a no-op: transform filled every shard) and FSDP1
  over ``smp.dp_mesh()`` with ``param_init_fn`` inside ``validate_params_and_buffers_inited()``
  (``sync_module_states`` off: PyTorch refuses it for CPU tensors);
* ``ours``: build under ``torch.device("meta")``, ``smp.DistributedModel``, then
  ``smp.load_hf_checkpoint`` (each rank reads only its slices).

Memory is measured honestly (FACTS.md): safetensors weights are memory-mapped, so every
parameter and buffer is touched in place (``mul_(1)`` on each local shard) before ``VmHWM`` is
read from ``/proc/self/status``; the number reported is that peak minus the RSS right after the
imports. Time is from the end of the imports to the touched, ready-to-train model. Each job
then runs one forward pass, and the script checks that all four give the same logits.

Usage: ``python bench/bench_loading_memory.py``; writes ``bench/results/loading_memory.json``.
``--small --nproc 4`` runs a 0.3 GB Llama (hidden 1024, 4 layers, vocabulary 16000) at TP=2 x
DP=2 into ``loading_memory_v2.json`` (FSDP then shards over two data-parallel ranks); ``--nproc 4``
alone runs the 1.7 GB model at TP=2 x DP=2 into ``loading_memory_nproc4.json``.
Not a test: it takes minutes and several GB of RAM. Timings are of one run on a shared machine
(the load average before each job is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=6, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
SMALL = dict(SHAPE, hidden_size=1024, intermediate_size=2752, num_hidden_layers=4, vocab_size=16000)
METHODS = ("naive", "hf_tp_auto", "sagemaker_v2", "v2_recipe_b", "ours")
RESULTS = Path(__file__).resolve().parent / "results" / "loading_memory.json"
IDS = [[1, 345, 2789, 31999, 7, 42, 1000, 5]]


def proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def write_checkpoint(directory: Path, shape: dict) -> int:
    """Random weights (std 0.02, norms ones) in HF's layout, one tensor at a time; returns bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02) for k, s in shapes.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(directory)
    return sum(t.numel() * 4 for t in tensors.values())


# ---- one method, on one rank (runs under torchrun) ---------------------------------------------

def _touch(model, torch) -> None:
    """An in-place op on every local tensor: memory-mapped weights become resident."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            (t.to_local() if isinstance(t, DTensor) else t).mul_(1)


def _naive(ckpt, smp, torch, cls, cfg):
    smp.init({"tensor_parallel_degree": 2})
    model = cls.from_pretrained(ckpt)
    _touch(model, torch)  # what moving it to a device does: the mapped weights become resident
    return smp.DistributedModel(model)


def _hf_tp_auto(ckpt, smp, torch, cls, cfg):
    return cls.from_pretrained(ckpt, tp_plan="auto")


def _sagemaker_v2(ckpt, smp, torch, cls, cfg):
    from accelerate import init_empty_weights

    smp.init({"tensor_parallel_degree": 2})
    if smp.rank() == 0:
        model = cls.from_pretrained(ckpt, low_cpu_mem_usage=True)
    else:
        with init_empty_weights():
            model = cls(cfg)
    return smp.transform(model, load_state_dict_from_rank0=True)


def _v2_recipe_b(ckpt, smp, torch, cls, cfg):
    import functools
    from contextlib import nullcontext

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from modelparallel.delayed_param import DelayedParamIniter

    model = _sagemaker_v2(ckpt, smp, torch, cls, cfg)
    initer = DelayedParamIniter(model) if smp.rank() != 0 else None
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    with initer.validate_params_and_buffers_inited() if initer else nullcontext():
        return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), device_mesh=smp.dp_mesh(),
                    use_orig_params=True, sync_module_states=False,
                    param_init_fn=initer.get_param_init_fn() if initer else None)


def _ours(ckpt, smp, torch, cls, cfg):
    smp.init({"tensor_parallel_degree": 2})
    with torch.device("meta"):
        model = smp.DistributedModel(cls(cfg))
    smp.load_hf_checkpoint(model, ckpt)
    return model


def worker(method: str, ckpt: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    import modelparallel as smp

    torch.set_num_threads(1)
    baseline = proc_status_mb("VmRSS")
    start = time.perf_counter()
    cfg = LlamaConfig.from_pretrained(ckpt)
    model = globals()["_" + method](ckpt, smp, torch, LlamaForCausalLM, cfg)
    _touch(model, torch)
    seconds = time.perf_counter() - start
    hwm = proc_status_mb("VmHWM")
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    rank = dist.get_rank()
    record = dict(rank=rank, baseline_rss_mb=round(baseline, 1), vmhwm_mb=round(hwm, 1),
                  peak_above_baseline_mb=round(hwm - baseline, 1), ready_seconds=round(seconds, 2),
                  logits_head=[round(float(x), 5) for x in logits[0, -1, :4]])
    Path(f"{out}.{rank}").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------------

def run_method(method: str, ckpt: Path, tmp: Path, nproc: int = 2) -> list[dict]:
    out = tmp / f"{method}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), __file__,
           "--worker", method, "--ckpt", str(ckpt), "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nproc)]


def table(results: dict, model_mb: float) -> str:
    first = results.get("naive", next(iter(results.values())))
    naive = max(r["peak_above_baseline_mb"] for r in first["ranks"])
    lines = [f"{'method':<14} {'rank 0 MB':>10} {'others MB':>10} {'max/naive':>10} {'max/model':>10} "
             f"{'others/model':>12} {'ready s':>8} {'load avg':>9}"]
    for m, res in results.items():
        peaks = [r["peak_above_baseline_mb"] for r in res["ranks"]]
        secs = max(r["ready_seconds"] for r in res["ranks"])
        others = max(peaks[1:])
        lines.append(f"{m:<14} {peaks[0]:>10.0f} {others:>10.0f} {max(peaks) / naive:>10.2f} "
                     f"{max(peaks) / model_mb:>10.2f} {others / model_mb:>12.2f} {secs:>8.1f} "
                     f"{res['load_avg_before']:>9.1f}")
    return "\n".join(lines)


def main(methods: tuple[str, ...] = METHODS, small: bool = False, nproc: int = 2) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        tmp = Path(tmp)
        ckpt = tmp / "llama"
        ckpt.mkdir()
        model_bytes = write_checkpoint(ckpt, SMALL if small else SHAPE)
        model_mb = model_bytes / 2**20
        print(f"checkpoint: {model_mb:.0f} MB fp32 at {ckpt}", flush=True)
        results = {}
        for method in methods:
            load = os.getloadavg()[0]
            print(f"running {method} (load average {load:.1f})...", flush=True)
            results[method] = {"ranks": run_method(method, ckpt, tmp, nproc), "load_avg_before": round(load, 1)}
    heads = {m: r["ranks"][0]["logits_head"] for m, r in results.items()}
    first = next(iter(heads.values()))
    same = all(max(abs(a - b) for a, b in zip(h, first)) < 1e-3 for h in heads.values())
    text = table(results, model_mb)
    print(text)
    print("all methods give the same logits:", same)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    out = RESULTS.with_name("loading_memory_v2.json") if small else RESULTS
    out = out if set(methods) == set(METHODS) or small else RESULTS.with_name("loading_memory_partial.json")
    out = out if small or nproc == 2 else RESULTS.with_name(f"loading_memory_nproc{nproc}.json")
    out.write_text(json.dumps({
        "model": dict(SMALL if small else SHAPE, dtype="float32", bytes=model_bytes), "tp": 2,
        "nproc": nproc, "methods": results,
        "same_logits": same, "model_mb": round(model_mb, 1), "table": text, "machine": dict(cpus=os.cpu_count(), python=platform.python_version()),
        "note": "one run; peak = VmHWM after touching every local tensor minus RSS after imports; "
                "load_avg_before is the 1-minute load average when the job started (shared machine)",
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=METHODS)
    parser.add_argument("--ckpt")
    parser.add_argument("--out")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset to run")
    parser.add_argument("--small", action="store_true", help="the 0.3 GB model instead of 1.7 GB")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (TP=2, the rest data parallel)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.ckpt, args.out)
    else:
        main(tuple(args.methods.split(",")), args.small, args.nproc)
