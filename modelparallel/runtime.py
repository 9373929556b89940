"""The one runtime handle: the job's ``Topology`` (config, device, meshes, groups), what the job
has made so far, and SMP's rank API.

``init`` is the only place that reads the launcher's environment. Everything inside the library
takes the topology (or a mesh of it) as an argument; the module-level ``_RUNTIME`` exists only so
the SMP-style facade (``smp.tp_rank()``, ``smp.get_tp_process_group()``...) has something to
read. The mesh dimensions, SageMaker's groups and how ranks are laid out are ``meshes``'s.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .config import build_config, without_effect
from . import devices, meshes
from .meshes import (  # noqa: F401 - the group names and layouts are part of this module's API
    CP_GROUP, DIMS, DP_CP_GROUP, DP_GROUP, EDP_GROUP, EP_GROUP, EXPERT_DIMS, GROUP_DIMS, MP_GROUP, PP_GROUP,
    RDP_GROUP, TP_GROUP, WORLD, CommGroup, expert_layout, members, mesh_layout, spanned)
from .topology import Topology

logger = logging.getLogger("modelparallel")


_RUNTIME: Runtime | None = None


@dataclass
class Runtime:
    """A running job: where it runs (``topology``, fixed by ``init``) and what it has made so far.

    The topology's names (``config``, ``device``, the meshes, ``group``, ``ranks``...) read through
    the runtime too, for the SMP-style facade; the engine is handed the ``Topology`` itself.
    ``models`` and ``optimizers`` record what the job created, newest last, for the API layer
    only (``smp.state.model``, ``@smp.step``, ``save_checkpoint``'s defaults). Internals never
    search them: an optimizer is linked to the models whose parameters it holds when it is
    built, and each model reads its own link.
    """

    topology: Topology
    models: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    resume: Any = None
    """The newest ``resume_from_checkpoint``'s ``PendingResume`` (waiting or done): its
    ``reports`` are what ``smp.last_load_report()`` returns."""
    step: Any = None
    """The running ``@smp.step`` call's ``StepContext``, or None outside a step."""
    held_locks: dict = field(default_factory=dict)
    """Locks this job holds until it ends (checkpoint directories it saved into, by real path);
    released when ``init`` starts another job."""
    offloaders: dict = field(default_factory=dict)
    """The job's activation offloaders, by prefetch horizon (``activations.offload``)."""
    checkpoint_saver: Any = None
    """The job's background checkpoint writer (``checkpoint.async_save.AsyncSaver``), made at its
    first asynchronous save."""
    checkpoint_queue: Any = None
    """SageMaker v2's default queue of asynchronous saves and its plan cache
    (``distributed.checkpoint.async_utils.AsyncCallsQueue``), made at the job's first v2 save
    that names no queue."""
    logged: set = field(default_factory=set)
    """Messages logged once per process already (config keys without effect, one-time notices):
    handed from each job to the next by ``init``."""

    def __getattr__(self, name: str):
        if name == "topology":  # not set yet (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.topology, name)

    @property
    def pending_resume(self):
        """The resume still waiting for its model or optimizer, or None."""
        return self.resume if self.resume is not None and self.resume.armed else None


def _device() -> torch.device:
    """``cuda:LOCAL_RANK`` when PyTorch sees a GPU, else the CPU (``devices`` has the rule and
    the ``MODELPARALLEL_DEVICE`` switch)."""
    return devices.rank_device(int(os.environ.get("LOCAL_RANK", 0)))


def _ensure_process_group(timeout: timedelta) -> None:
    """Join the launcher's process group, or make a world of one when run as a plain process."""
    if dist.is_initialized():
        return
    backend = devices.backend()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def configure_logging(global_rank: int) -> None:
    """Show the library's INFO lines (what stays replicated, the layout) unless the user has
    configured the ``modelparallel`` logger already."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[modelparallel rank {global_rank}] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def init(config: dict | str | None = None, *, timeout_s: float = 300.0, api: str | None = None) -> Runtime:
    """Start (or restart) the distributed runtime.

    Args:
        config: a dict, a JSON file path, or None to read ``MODELPARALLEL_CONFIG``.
        timeout_s: collective timeout; a rank that fails makes the others fail within it.
        api: "v2" when ``transform`` starts the job: the config is also checked against what only
            the v1 API runs (``config.unbuilt_combinations``).

    Returns:
        The runtime handle (also reachable through the module-level rank API).

    Raises:
        ValueError: for any invalid config, before any collective runs.
        NotImplementedError: for keys or combinations of dimensions not built, all named at once.
    """
    global _RUNTIME
    world = int(os.environ.get("WORLD_SIZE", 1)) if not dist.is_initialized() else dist.get_world_size()
    cfg = build_config(config, world, api)
    if _RUNTIME is not None:
        if _RUNTIME.checkpoint_saver is not None:  # the previous job's save in flight ends first
            try:
                _RUNTIME.checkpoint_saver.wait()
            except Exception as e:  # noqa: BLE001 - that job is over: say what it lost
                logger.error("the previous job's asynchronous checkpoint failed: %s", str(e).splitlines()[0])
        for lock in _RUNTIME.held_locks.values():
            lock.release()
    device = _device()  # before the process group: NCCL binds to the current GPU
    _ensure_process_group(timedelta(seconds=timeout_s))
    layout, ep = mesh_layout(cfg), cfg.expert_parallel_degree
    cache = meshes.carried(_RUNTIME.mesh_cache if _RUNTIME is not None else None)
    built = cache.get(device, layout, ep, lambda: meshes.build(device, layout, cfg.dp_degree, ep))
    world_mesh = built.world
    if dist.get_world_size() > 1:
        meshes.background_group(cache)  # now, not at the first asynchronous save (see there)
    torch.manual_seed(cfg.random_seed)
    random.seed(cfg.random_seed)
    topology = Topology(config=cfg, world_mesh=world_mesh, mesh=world_mesh["dp", "tp"], device=device,
                        expert_mesh=built.expert, groups=built.groups, mesh_cache=cache)
    _RUNTIME = Runtime(topology, logged=_RUNTIME.logged if _RUNTIME is not None else set())
    configure_logging(dist.get_rank())
    if dist.get_rank() == 0:
        logger.info("world %d = %s on %s", cfg.world_size,
                    " x ".join(f"{d} {n}" for d, n in zip(DIMS, world_mesh.mesh.shape) if n > 1 or d in ("dp", "tp")),
                    device.type)
        _log_without_effect(_RUNTIME.logged, without_effect(config))
    return _RUNTIME




def log_once(log: logging.Logger, message: str) -> None:
    """Log ``message`` at info level the first time this process asks (within a job: the set of
    what was logged is the runtime's, handed on by each ``init``)."""
    logged = _RUNTIME.logged if _RUNTIME is not None else set()
    if message not in logged:
        logged.add(message)
        log.info(message)


def _log_without_effect(logged: set[str], keys: dict[str, Any]) -> None:
    """Say once per process which given keys tune SageMaker machinery that does not exist here."""
    fresh = {k: v for k, v in keys.items() if k not in logged}
    if fresh:
        logged.update(fresh)
        logger.info("config keys accepted with no effect here: %s",
                    ", ".join(f"{k}={v!r}" for k, v in sorted(fresh.items())))


def current() -> Runtime:
    """The runtime started by ``init``; raises if there is none."""
    if _RUNTIME is None:
        raise RuntimeError("modelparallel is not initialized: call modelparallel.init() first")
    return _RUNTIME


def is_initialized() -> bool:
    return _RUNTIME is not None


# ---- SMP's rank API -------------------------------------------------------------------------
# One rule for every group: a rank's number in a group is its place in ``Runtime.ranks``, the
# group's size is that list's length.

_GROUP_DOCS = {
    WORLD: "every rank of the job",
    TP_GROUP: "the tensor-parallel group: ranks sharing one copy of each layer",
    RDP_GROUP: "the reduced-data-parallel group: ranks holding the same shard (same tp and pp "
               "rank); shard data with rdp_rank/rdp_size when prescaled_batch is true",
    DP_GROUP: "the data-parallel group: ranks with this rank's pp rank (all of them at pipeline "
              "degree 1); shard data with dp_rank/dp_size when prescaled_batch is false",
    MP_GROUP: "the ranks that together hold one model copy",
    PP_GROUP: "the pipeline group: ranks with this rank's tp and rdp rank, one per stage",
    EP_GROUP: "the expert-parallel group: data-parallel ranks that hold one copy of the experts between them",
    EDP_GROUP: "the expert-data-parallel group: ranks holding this rank's experts (same ep rank)",
    CP_GROUP: "the context-parallel group: ranks splitting the same sequences",
    DP_CP_GROUP: "the data x context parallel ranks: ranks holding the same parameters (same tp and pp rank)",
}


def _group_api(group: CommGroup, rank_name: str, size_name: str, pg_name: str):
    """``(rank, size, process_group)`` getters of one group, named as SageMaker names them."""
    def rank_in() -> int:
        return current().ranks(group).index(dist.get_rank())

    def size_of() -> int:
        return len(current().ranks(group))

    def process_group() -> dist.ProcessGroup:
        return current().group(group)

    what = _GROUP_DOCS[group]
    for fn, name, doc in ((rank_in, rank_name, "This rank's number in {}."), (size_of, size_name, "Size of {}."),
                          (process_group, pg_name, "The process group of {}.")):
        fn.__name__ = fn.__qualname__ = name
        fn.__doc__ = doc.format(what)
    return rank_in, size_of, process_group


rank, size, get_world_process_group = _group_api(WORLD, "rank", "size", "get_world_process_group")
tp_rank, tp_size, get_tp_process_group = _group_api(TP_GROUP, "tp_rank", "tp_size", "get_tp_process_group")
rdp_rank, rdp_size, get_rdp_process_group = _group_api(RDP_GROUP, "rdp_rank", "rdp_size",
                                                       "get_rdp_process_group")
dp_rank, dp_size, get_dp_process_group = _group_api(DP_GROUP, "dp_rank", "dp_size", "get_dp_process_group")
mp_rank, mp_size, get_mp_process_group = _group_api(MP_GROUP, "mp_rank", "mp_size", "get_mp_process_group")
pp_rank, pp_size, get_pp_process_group = _group_api(PP_GROUP, "pp_rank", "pp_size", "get_pp_process_group")
ep_rank, ep_size, get_ep_process_group = _group_api(EP_GROUP, "ep_rank", "ep_size", "get_ep_process_group")
cp_rank, cp_size, get_cp_process_group = _group_api(CP_GROUP, "cp_rank", "cp_size", "get_cp_process_group")


def local_rank() -> int:
    """This rank's number on its node (the launcher's ``LOCAL_RANK``)."""
    current()
    return int(os.environ.get("LOCAL_RANK", 0))


def local_size() -> int:
    """Ranks on this node (the launcher's ``LOCAL_WORLD_SIZE``)."""
    current()
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))
