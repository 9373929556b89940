"""SageMaker v2's checkpoint calls: training time blocked by ``async_save`` against ``save``.

A Llama (``--hidden``, ``--layers``; vocabulary 1024) from ``transform`` at TP=2 on two ranks,
wrapped in FSDP1 as SageMaker v2 scripts wrap it (``TransformerLayer`` units, ``use_orig_params``),
AdamW state present. Per repeat, for a sharded (``SHARDED_STATE_DICT``, FSDP process group) and a
local (``SM_LOCAL_STATE_DICT``, replication group) state dict:

* ``sync``: ``save`` (plan, stage, write, finalize) - the training time one save blocks;
* ``async blocked``: ``async_save`` until it returns (plan, copy to host buffers of what a forward
  may change) plus the time the next step's optimizer step waits for the background copy of the
  rest (``hook_wait_s``): the part of an asynchronous save training waits for;
* ``step while writing`` against ``step``: one training step while the background copy and write
  run, against one without (the slowdown the writer thread causes, the wait included), then
  ``finalize``;
* ``dcp_async`` (sharded only: DCP's stager cannot copy a local state dict's views of FSDP's flat
  parameters): the peer, PyTorch's own ``torch.distributed.checkpoint.async_save`` of the same
  state dict over the same group: its call (it copies every tensor to host memory there, then
  plans and writes in a thread) and, after a step, the wait for its future;
* ``read_vs_copy`` (once, after the rounds): the two ways the call can keep what it saves from an
  in-place change through ``.data`` or numpy: the CRC-32 of every deferred tensor (what it does)
  against a copy of them all into reused buffers, both ranks at once.

Making the state dicts (``state_dict_s``: FSDP's sharded optimizer state dict gathers) is the same
for both and timed apart.

``async_call_cpu_s`` is the CPU time of the rank's process during the call (its threads
together): on a shared machine the call's wall time also counts the time other programs held the
cores, its CPU time does not.

Times are the slowest rank's, medians (and min / max: ``spread``) over the repeats after a
warm-up round; bytes are the checkpoint's size on disk and the queue's staging buffers. The
headline is ``async blocked / sync`` (issue 30's goal: <= 5%). From the second round on, the
queue reuses its save plan (``plan_reused``): the warm-up round pays the full planning.

Usage: ``python bench/bench_v2_async_save.py [--hidden 512] [--layers 4] [--repeats 3]``
(about 1-2 minutes at the defaults on a quiet machine); writes ``bench/results/v2_async_save.json``
with the load averages: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _build(hidden: int, layers: int):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaConfig, LlamaForCausalLM

    import modelparallel as tsm
    from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=1024, use_cache=False)
    model = tsm.transform(LlamaForCausalLM(config))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, optimizer) -> float:
    import torch

    start = time.perf_counter()
    ids = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _state_dict(kind: str, model, optimizer) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from modelparallel.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type

    if kind == "sharded":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer)}
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _group(kind: str, model):
    import torch.distributed as dist

    from modelparallel import state

    if kind == "sharded":
        return model.process_group
    mine = None
    for ranks in state.ranker.get_rep_groups():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _one_round(kind, model, optimizer, root, queue) -> dict:
    import torch.distributed as dist

    from modelparallel.distributed.checkpoint.state_dict_saver import async_save, save
    from modelparallel.sagemaker.utils.process_group_utils import get_global_ranks

    group = _group(kind, model)
    from modelparallel import state

    where = os.path.join(root, kind, f"tp{state.tp_rank}" + (f"_r{dist.get_rank()}" if kind == "local" else ""))
    kwargs = dict(checkpoint_id=where, process_group=group, coordinator_rank=min(get_global_ranks(group)))
    shutil.rmtree(where, ignore_errors=True)
    t0 = time.perf_counter()
    state_dict = _state_dict(kind, model, optimizer)
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    save(state_dict, **kwargs)
    sync = time.perf_counter() - t0
    del state_dict
    size = sum(f.stat().st_size for f in Path(where).rglob("*") if f.is_file())
    plain = _step(model, optimizer)
    hits = queue.plans.hits
    watched = _async_part(kind, model, optimizer, queue, kwargs, group, watch=True)
    read = _async_part(kind, model, optimizer, queue, kwargs, group, watch=False)
    # the peer for the sharded state dict only: DCP's stager cannot copy a local state dict's FSDP flat views
    peer = _dcp_async(kind, model, optimizer, where + "_dcp", group) if kind == "sharded" else []
    slow = common.slowest([sync, plain, made, *watched, *read, *peer])
    names = ("async_blocked_s", "async_call_s", "hook_wait_s", "step_while_writing_s", "finalize_s", "async_call_cpu_s")
    return dict(zip(("sync_s", "step_s", "state_dict_s", *names, *(f"read_{n}" for n in names),
                     *(("dcp_async_call_s", "dcp_async_finalize_s") if peer else ())), slow),
                bytes_on_this_rank=size, staging_bytes=queue.staging_bytes, plan_reused=queue.plans.hits > hits)


def _dcp_async(kind, model, optimizer, where: str, group) -> list[float]:
    """The peer: PyTorch's own ``torch.distributed.checkpoint.async_save`` of the same state dict
    over the same group (it copies every tensor to host memory in the call, then plans and
    writes in a thread): the call, then (after a step) the wait for its future."""
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(where, ignore_errors=True)
    state_dict = _state_dict(kind, model, optimizer)
    t0 = time.perf_counter()
    future = dcp.async_save(state_dict, checkpoint_id=where, process_group=group)
    call = time.perf_counter() - t0
    del state_dict
    _step(model, optimizer)
    t0 = time.perf_counter()
    future.result()
    done = time.perf_counter() - t0
    shutil.rmtree(where, ignore_errors=True)
    return [call, done]


_WATCH: dict = {}
"""The queue's write tracking, kept while a round turns it off."""


def _async_part(kind, model, optimizer, queue, kwargs, group, watch: bool) -> list[float]:
    """One ``async_save`` with the kernel's write tracking (``watch``) or with the call reading the
    deferred tensors (as where the kernel offers none): blocked, call, step wait, step, finalize,
    call CPU (this rank)."""
    from modelparallel.distributed.checkpoint.state_dict_saver import async_save

    _WATCH.setdefault(id(queue), queue.saver.stager.pages)
    queue.saver.stager.pages = _WATCH[id(queue)] if watch else None
    state_dict = _state_dict(kind, model, optimizer)
    t0, c0 = time.perf_counter(), time.process_time()
    async_save(state_dict, queue=queue, **kwargs)
    call, call_cpu = time.perf_counter() - t0, time.process_time() - c0
    del state_dict
    job = queue.saver.job
    during = _step(model, optimizer)  # its optimizer step waits for the background copy, if not done
    t0 = time.perf_counter()
    queue.maybe_finalize_async_calls(blocking=True, process_group=group)
    return [call + job.held_s, call, job.held_s, during, time.perf_counter() - t0, call_cpu]


def _read_vs_copy(kind: str, model, optimizer, tries: int = 5) -> dict:
    """What the call pays per deferred byte, each way it could keep a checkpoint from a change
    through ``.data`` (issue 41): write-protecting their pages (``protect_s``, the kernel's write
    tracking, where it exists, at any save size; ``clear_s``: what the background thread pays
    after the copies), the CRC-32 of every deferred tensor (where it does not: the copy is
    left to the background) and copying them all into reused buffers (what
    ``background_staging=False`` does); medians over ``tries``, both ranks at once, slowest rank."""
    import torch
    import torch.distributed as dist

    from modelparallel.checkpoint.background.deferred import fingerprint
    from modelparallel.checkpoint.background.pages import PageWatch
    from modelparallel.distributed.checkpoint.staging import deferrable

    memory: list = []
    with torch.no_grad():
        deferrable(_state_dict(kind, model, optimizer), memory)
    memory = [t for t in memory if t.is_contiguous() and t.numel() > 0]
    buffers = [torch.empty_like(t) for t in memory]
    times: dict[str, list] = {"crc_s": [], "copy_s": [], "protect_s": [], "clear_s": []}
    watch = PageWatch.open()
    if watch is not None:
        watch.min_save_bytes = 0  # measured at any size

    def protect():  # the call's part: the edges read, the mappings read and registered, pages protected
        watch.start()
        marks = [(t, watch.claim(t)) for t in memory]
        edges = [mark.edges(t) for t, mark in marks if mark is not None]
        return watch.protect_claimed(), edges

    def clear():  # the background thread's part, after the copies
        watch.release()
        watch.unregister()

    for _ in range(tries):
        for key, run in (("crc_s", lambda: [fingerprint(t) for t in memory]),
                         ("copy_s", lambda: [b.copy_(t) for b, t in zip(buffers, memory)]),
                         ("protect_s", protect if watch is not None else lambda: None),
                         ("clear_s", clear if watch is not None else lambda: None)):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times[key].append(common.slowest([time.perf_counter() - t0])[0])
    nbytes = sum(t.numel() * t.element_size() for t in memory)
    out = {k: statistics.median(v) for k, v in times.items()}
    return {**out, "bytes": nbytes, "crc_gb_s": nbytes / out["crc_s"] / 1e9, "copy_gb_s": nbytes / out["copy_s"] / 1e9}


def _spread(values) -> dict:
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def rank_main(hidden: int, layers: int, repeats: int) -> dict:
    import modelparallel as tsm
    from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue

    tsm.init({"tensor_parallel_degree": 2})
    model, optimizer = _build(hidden, layers)
    _step(model, optimizer)
    queues = {kind: AsyncCallsQueue() for kind in ("sharded", "local")}  # staging_bytes: one state dict's
    root = tempfile.mkdtemp(prefix="bench-v2-save-") if int(os.environ["RANK"]) == 0 else None
    import torch.distributed as dist

    box = [root]
    dist.broadcast_object_list(box, src=0)
    out = {}
    try:
        for kind in ("sharded", "local"):
            rounds = [_one_round(kind, model, optimizer, box[0], queues[kind]) for _ in range(repeats + 1)][1:]
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            med["async_blocked_over_sync"] = med["async_blocked_s"] / med["sync_s"]
            med["read_async_blocked_over_sync"] = med["read_async_blocked_s"] / med["sync_s"]
            if "dcp_async_call_s" in med:
                med["dcp_async_call_over_sync"] = med["dcp_async_call_s"] / med["sync_s"]
            spread = {"async_blocked_over_sync": _spread(r["async_blocked_s"] / r["sync_s"] for r in rounds),
                      "read_async_blocked_over_sync": _spread(r["read_async_blocked_s"] / r["sync_s"] for r in rounds),
                      "async_call_cpu_s": _spread(r["async_call_cpu_s"] for r in rounds),
                      "read_async_call_cpu_s": _spread(r["read_async_call_cpu_s"] for r in rounds),
                      "step_slowdown_while_writing": _spread(r["step_while_writing_s"] / r["step_s"] for r in rounds),
                      "async_blocked_s": _spread(r["async_blocked_s"] for r in rounds)}
            if "dcp_async_call_s" in med:
                spread["dcp_async_call_over_sync"] = _spread(r["dcp_async_call_s"] / r["sync_s"] for r in rounds)
            out[kind] = {"median": med, "spread": spread, "rounds": rounds,
                         "read_vs_copy": _read_vs_copy(kind, model, optimizer)}
    finally:
        for queue in queues.values():
            queue.close()
        dist.barrier()
        if box[0] and int(os.environ["RANK"]) == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = common.load_average()
    records = common.spawn(rank_main, 2, args.hidden, args.layers, args.repeats)
    result = {"bench": "v2_async_save", "hidden": args.hidden, "layers": args.layers, "repeats": args.repeats,
              "tp": 2, "ranks": 2, "load_average_before": load_before, "load_average_after": common.load_average(),
              "result": records[0]}
    for kind, rec in records[0].items():
        m, sp = rec["median"], rec["spread"]["async_blocked_over_sync"]
        print(f"{kind}: sync {m['sync_s']:.3f}s, async blocked {m['async_blocked_s']:.3f}s "
              f"({m['async_blocked_over_sync']:.1%}; min/median/max {sp['min']:.1%}/{sp['median']:.1%}/"
              f"{sp['max']:.1%}; call {m['async_call_s']:.3f}s (CPU {m['async_call_cpu_s']:.3f}s) + step wait "
              f"{m['hook_wait_s']:.3f}s), "
              f"step {m['step_s']:.3f}s / while writing {m['step_while_writing_s']:.3f}s, "
              f"finalize {m['finalize_s']:.3f}s, state dicts {m['state_dict_s']:.3f}s, "
              f"staging {m['staging_bytes'] / 1e6:.1f} MB/rank; without write tracking (reading): blocked "
              f"{m['read_async_blocked_over_sync']:.1%}, call CPU {m['read_async_call_cpu_s']:.3f}s"
              + (f"; DCP's async_save: its call {m['dcp_async_call_s']:.3f}s ({m['dcp_async_call_over_sync']:.1%})"
                 if "dcp_async_call_s" in m else ""))
        rc = rec["read_vs_copy"]
        print(f"{kind}: the deferred {rc['bytes'] / 1e6:.1f} MB/rank: CRC-32 {rc['crc_s'] * 1e3:.1f} ms "
              f"({rc['crc_gb_s']:.1f} GB/s), copy {rc['copy_s'] * 1e3:.1f} ms ({rc['copy_gb_s']:.1f} GB/s), "
              f"write-protect {rc['protect_s'] * 1e3:.1f} ms in the call, clear {rc['clear_s'] * 1e3:.1f} ms after")
    print(f"load average before {load_before}, after {result['load_average_after']}")
    common.write_result("v2_async_save", result, args.out)


if __name__ == "__main__":
    main()
