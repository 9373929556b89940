"""Analysis helpers of ``profile_tp.py``: op categories, counts, GEMM replay, DTensor op counts."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"}
COPY = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::cat", "aten::stack"}
VIEWS = {"aten::view", "aten::t", "aten::transpose", "aten::permute", "aten::expand", "aten::detach",
         "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::as_strided", "aten::_unsafe_view",
         "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::split",
         "aten::unflatten", "aten::flatten", "aten::alias", "aten::lift_fresh", "aten::resolve_conj",
         "aten::resolve_neg", "aten::result_type", "aten::zeros", "aten::narrow", "aten::chunk",
         "aten::split_with_sizes", "aten::unbind", "aten::_reshape_alias", "aten::view_as", "aten::expand_as",
         "detach", "aten::to", "aten::matmul", "aten::linear"}
COUNTED = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::copy_", "aten::clone",
           "aten::contiguous", "aten::permute", "aten::transpose", "aten::t", "aten::cat", "aten::_to_copy")
CATEGORIES = ("gemm", "attention", "comm", "copy", "views", "elementwise", "optimizer", "framework")


def _is_comm(name: str) -> bool:
    return any(k in name for k in ("c10d", "all_reduce", "allreduce", "wait_tensor", "all_gather", "allgather",
                                   "reduce_scatter", "comm:", "broadcast", "barrier"))


def _category(evt, in_optimizer: bool) -> str | None:
    name = evt.name
    if in_optimizer:
        return "optimizer"
    if _is_comm(name):
        return "comm"
    if not name.startswith("aten::"):
        return None  # record_function spans (autograd nodes, the step): their self time is framework
    if name in GEMM:
        return "gemm"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name in COPY:
        return "copy"
    return "views" if name in VIEWS else "elementwise"


def _is_wrapper(evt) -> bool:
    """An op dispatched on a tensor subclass (DTensor): the profiler records it and, inside it, the
    same op on the local tensors. The outer one's self time is sharding propagation and wrapping."""
    stack = list(evt.cpu_children)
    while stack:
        child = stack.pop()
        if child.name == evt.name:
            return True
        stack.extend(child.cpu_children)
    return False


def _inside(evt, prefix: str) -> bool:
    while evt is not None:
        if evt.name.startswith(prefix):
            return True
        evt = evt.cpu_parent
    return False


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _wrap_collectives():
    """Give plain ``torch.distributed`` collectives a profiler span covering their wait, so a
    synchronous ``dist.all_reduce`` counts as communication, not framework time."""
    import torch
    import torch.distributed as dist

    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier"):
        inner = getattr(dist, name)

        def wrapped(*a, _inner=inner, _name=name, **k):
            with torch.profiler.record_function(f"comm:{_name}"):
                return _inner(*a, **k)
        setattr(dist, name, wrapped)


def dtensor_op_counts(step) -> Counter:
    """ATen ops that ran on DTensor arguments during one ``step()`` (each costs sharding
    propagation and re-wrapping on top of the local kernel), by op name."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    counts: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0]):
                counts[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    del torch
    return counts


def gemm_calls(step) -> Counter:
    """The local GEMMs of one ``step()`` as (op, operand shapes and strides) -> calls."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch.distributed.tensor import DTensor

    calls: Counter = Counter()
    names = {n.split("::")[1] for n in GEMM}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in names:  # a DTensor op runs the same op on the local tensors
                local = [a._local_tensor if isinstance(a, DTensor) else a for a in args if hasattr(a, "stride")]
                calls[(func.overloadpacket.__name__, tuple((tuple(a.shape), a.stride()) for a in local))] += 1
            return func(*args, **(kwargs or {}))

    with Record():
        step()
    return calls


def replay_gemms(calls: Counter, reps: int = 3) -> list[dict]:
    """Each recorded GEMM rerun alone with its operands' shapes and strides, timed in thread CPU
    seconds (the median of ``reps``): unlike wall time this hardly moves when other processes
    share the cores, so it compares GEMM layouts on a busy machine."""
    import torch

    out = []
    for (name, ops), n in calls.items():
        tensors = [torch.empty_strided(shape, stride).normal_() for shape, stride in ops]
        fn = getattr(torch, name)
        samples = []
        for _ in range(reps):
            t0 = time.thread_time()
            fn(*tensors)
            samples.append(time.thread_time() - t0)
        out.append(dict(op=name, operands=[list(map(list, o)) for o in ops], calls=n,
                        cpu_s=n * sorted(samples)[len(samples) // 2]))
    return sorted(out, key=lambda r: -r["cpu_s"])


def analyse(prof, walls: list[float]) -> dict:
    """Per-step time by category, counts, copy bytes, collectives and the GEMM shapes."""
    steps = len(walls)
    cat_us: dict[str, float] = defaultdict(float)
    counts: Counter = Counter()
    gemm_shapes: dict[str, float] = defaultdict(float)
    comm: Counter = Counter()
    copy_bytes = 0
    for evt in prof.events():
        opt = _inside(evt, "Optimizer.")
        cat = None if _is_wrapper(evt) else _category(evt, opt)
        if cat is not None:
            cat_us[cat] += evt.self_cpu_time_total
        if opt or _is_wrapper(evt):
            continue
        counts[evt.name] += 1
        if evt.name == "aten::copy_" and evt.input_shapes:
            copy_bytes += 4 * _numel(evt.input_shapes[0])  # fp32 benchmark: 4 bytes per element
        if evt.name in GEMM:
            shapes = "x".join(str(list(s)) for s in evt.input_shapes if s)
            gemm_shapes[f"{evt.name} {shapes}"] += evt.self_cpu_time_total
        if _is_comm(evt.name) and evt.input_shapes and evt.input_shapes[0]:
            comm[f"{evt.name} {_numel(evt.input_shapes[0])}"] += 1
    wall_us = 1e6 * sum(walls)
    times = {c: cat_us.get(c, 0.0) / steps / 1e6 for c in CATEGORIES[:-1]}
    times["framework"] = max(0.0, (wall_us - sum(cat_us.values())) / steps / 1e6)
    top = sorted(gemm_shapes.items(), key=lambda kv: -kv[1])[:12]
    return dict(step_s=sum(walls) / steps, seconds=times,
                fractions={c: t / (wall_us / steps / 1e6) for c, t in times.items()},
                counts={k: counts[k] / steps for k in COUNTED}, copy_mb=copy_bytes / steps / 2**20,
                collectives={k: v / steps for k, v in sorted(comm.items())},
                gemm_top={k: v / steps / 1e6 for k, v in top})
