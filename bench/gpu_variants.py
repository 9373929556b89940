"""The variants ``bench_gpu.py`` measures, one per process (``run``): each builds its model on the
device, trains ``--warmup`` steps, then ``--repeats`` x ``--steps`` timed steps, and reports tokens/s
per repeat and peak memory (the checkpoint variants: save and load times instead of repeats).

Every timing ends with a device synchronization, so it covers the work, not its queuing.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

import common

LR = 1e-4


def _torch():
    import torch

    return torch


def device_of(args):
    torch = _torch()
    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


def sync(device) -> None:
    if device.type == "cuda":
        _torch().cuda.synchronize(device)


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                       max_position_embeddings=args.seq, tie_word_embeddings=False)


def flops_per_token(args) -> tuple[float, int]:
    """(model FLOPs per trained token, parameter count): 6 x matmul weights (all but the input
    embedding; Llama has no biases) + 12 x layers x hidden x seq for attention."""
    head = args.hidden // args.heads
    per_layer = 2 * args.hidden ** 2 + 2 * args.hidden * args.kv_heads * head + 3 * args.hidden * args.intermediate
    matmul = args.layers * per_layer + args.vocab * args.hidden
    params = matmul + args.vocab * args.hidden + args.layers * 2 * args.hidden + args.hidden
    return 6.0 * matmul + 12.0 * args.layers * args.hidden * args.seq, params


def adamw(params, args):
    impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.adamw]
    return _torch().optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, **impl)


def batch(args, device):
    torch = _torch()
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)


def world_of_one(device, cpu_side: bool = False) -> None:
    """A process group of this process alone (NCCL on CUDA; with ``cpu_side``, gloo beside it for
    CPU tensors, which DCP's asynchronous save needs)."""
    import torch.distributed as dist

    backend = "gloo" if device.type == "cpu" else ("cuda:nccl,cpu:gloo" if cpu_side else "nccl")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# ---- models and their steps ------------------------------------------------------------------------

def plain_v1(args, device):
    """bf16 weights; AdamW on fp32 masters; the weights copied back after each step."""
    torch = _torch()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(args)).to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    opt = adamw(masters, args)
    ids = batch(args, device)

    def step():
        model(ids, labels=ids).loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)

    return step, {"model": model.state_dict(), "masters": {str(i): m for i, m in enumerate(masters)}}, opt


def ours_v1(args, device):
    """``smp.DistributedModel`` + ``smp.DistributedOptimizer`` + ``@smp.step``, config bf16."""
    torch = _torch()
    from transformers import LlamaForCausalLM

    import modelparallel as smp

    smp.init({"tensor_parallel_degree": 1, "bf16": True})
    with smp.delay_param_initialization(enabled=True):
        module = LlamaForCausalLM(llama_config(args))
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(adamw(model.parameters(), args))
    ids = batch(args, device)

    @smp.step
    def forward_backward(model, ids):
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        return loss

    def step():
        forward_backward(model, ids)
        opt.step()
        opt.zero_grad()

    assert next(model.parameters()).device == device and torch.is_tensor(ids)
    return step, None, opt


def _fsdp2(args, device, model, mesh):
    torch = _torch()
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = adamw(model.parameters(), args)
    ids = batch(args, device)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step, None, opt


def plain_fsdp2(args, device):
    """The HF model under FSDP2 with bf16 compute over fp32 weights."""
    torch = _torch()
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    world_of_one(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(args))
    return _fsdp2(args, device, model, init_device_mesh(device.type, (1,), mesh_dim_names=("dp",)))


def ours_v2(args, device):
    """The same FSDP2 calls over ``smp.transform`` (a SageMaker v2 script at TP=1)."""
    torch = _torch()
    from transformers import LlamaForCausalLM

    import modelparallel as smp

    smp.init({"tensor_parallel_degree": 1})
    torch.manual_seed(0)
    with torch.device(device):
        model = smp.transform(LlamaForCausalLM(llama_config(args)))
    return _fsdp2(args, device, model, smp.dp_mesh())


# ---- measurements ----------------------------------------------------------------------------------

def throughput(step, args, device) -> dict:
    for _ in range(args.warmup):
        step()
    sync(device)
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync(device)
        rates.append(args.batch * args.seq * args.steps / (time.perf_counter() - start))
    return common.spread(rates)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_ours(args, device, step) -> dict:
    import modelparallel as smp

    root = Path(args.ckpt_dir, "ours")
    sync(device)
    start = time.perf_counter()
    smp.save_checkpoint(root, "sync", async_save=False)
    sync_s = time.perf_counter() - start
    blocked, written, after = [], [], []
    alone = _step_s(step, device)
    for i in range(args.saves):
        step()
        sync(device)
        start = time.perf_counter()
        smp.save_checkpoint(root, f"async{i}", async_save=True, num_kept_partial_checkpoints=1)
        blocked.append(time.perf_counter() - start)
        after.append(_step_s(step, device))  # its optimizer step waits for a live background copy
        smp.wait_for_checkpoints()  # the next save's blocked time is its own staging, not this write
        written.append(time.perf_counter() - start)
    resume = _resumes(root, device, lambda: smp.resume_from_checkpoint(root))  # the newest: the last async save
    return {"sync_save_s": sync_s, "async_blocked_s": blocked, "async_until_committed_s": written,
            "step_s": alone, "step_after_async_save_s": after,
            **resume, "bytes": _dir_bytes(root / f"async{args.saves - 1}_partial")}


def _step_s(step, device) -> float:
    """Seconds of one training step (the device synchronized before and after)."""
    sync(device)
    start = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - start


def _resumes(root: Path, device, load) -> dict:
    """Load timed twice: from the page cache (the files read once before: our save drops what
    it wrote from the cache, DCP's does not) and from disk (the files evicted first)."""
    out = {}
    for kind, prepare in (("resume_s", common.cache), ("resume_cold_s", common.evict)):
        prepare(root)
        sync(device)
        start = time.perf_counter()
        load()
        sync(device)
        out[kind] = time.perf_counter() - start
    return out


def checkpoint_dcp(args, device, step, state) -> dict:
    import torch.distributed.checkpoint as dcp

    root = Path(args.ckpt_dir, "dcp")
    sync(device)
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=root / "sync")
    sync_s = time.perf_counter() - start
    blocked, written = [], []
    for i in range(args.saves):
        step()
        sync(device)
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=root / f"async{i}")
        blocked.append(time.perf_counter() - start)
        future.result()
        written.append(time.perf_counter() - start)
        shutil.rmtree(root / ("sync" if i == 0 else f"async{i - 1}"))  # one kept, as ours keeps (disk space)
    last = root / f"async{args.saves - 1}"
    resume = _resumes(last, device, lambda: dcp.load(state, checkpoint_id=last))
    return {"sync_save_s": sync_s, "async_blocked_s": blocked, "async_until_committed_s": written,
            **resume, "bytes": _dir_bytes(last)}


def _dcp_state(state, opt) -> dict:
    """The plain model's bf16 weights, fp32 masters and AdamW moments, as tensors only."""
    moments = {k: {str(i): s[k] for i, s in enumerate(opt.state.values())} for k in ("exp_avg", "exp_avg_sq")}
    return {**state, **moments}


BUILDERS = {"plain-v1": plain_v1, "ours-v1": ours_v1, "plain-fsdp2": plain_fsdp2, "ours-v2": ours_v2,
            "ckpt-dcp": plain_v1, "ckpt-ours": ours_v1}


def run(args) -> dict:
    """Build and measure ``args.child``; its record."""
    torch = _torch()
    device = device_of(args)
    host_base = common.baseline_mb()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the allocator's statistics exist only once CUDA is initialized
        torch.cuda.reset_peak_memory_stats(device)
    if args.child == "ckpt-dcp":
        world_of_one(device, cpu_side=True)
    step, state, opt = BUILDERS[args.child](args, device)
    record = {"variant": args.child}
    if args.child.startswith("ckpt-"):
        step()  # the optimizer's state exists from the first step on
        try:
            record["checkpoint"] = (checkpoint_dcp(args, device, step, _dcp_state(state, opt))
                                    if args.child == "ckpt-dcp" else checkpoint_ours(args, device, step))
        finally:
            shutil.rmtree(Path(args.ckpt_dir, args.child.removeprefix("ckpt-")), ignore_errors=True)
    else:
        record["tokens_per_s"] = throughput(step, args, device)
    sync(device)
    flops, params = flops_per_token(args)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else \
        (common.status_mb("VmHWM") - host_base) / 1024
    record.update(peak_memory_gib=peak, host_peak_above_imports_gib=(common.status_mb("VmHWM") - host_base) / 1024,
                  flops_per_token=flops, parameters=params, device=args.device,
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else common.machine()["cpu"],
                  torch=torch.__version__, threads=torch.get_num_threads(), pid=os.getpid())
    if "tokens_per_s" in record:
        record["step_time_s_median"] = args.batch * args.seq / statistics.median(record["tokens_per_s"]["values"])
    return record
