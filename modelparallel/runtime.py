"""The one runtime handle: process group, device, the world mesh and SMP's rank API.

``init`` is the only place that reads the launcher's environment. Everything inside the library
takes the mesh (or this handle) as an argument; the module-level ``_RUNTIME`` exists only so the
SMP-style facade (``smp.tp_rank()``, ``smp.get_tp_process_group()``...) has something to read.

The world mesh has one named dimension per kind of parallelism, ``("pp", "dp", "cp", "tp")``
(pipeline stages, reduced data parallelism, context parallelism, tensor parallelism); a degree of
1 gives a dimension of size 1. ``Runtime.mesh`` is its ``("dp", "tp")`` slice holding this rank:
the ranks of one pipeline stage and one context slice, the mesh TP and FSDP work on.

Rank vocabulary (SageMaker's). ``TP_GROUP``: ranks sharing one copy of each layer. ``RDP_GROUP``
(reduced data parallel): ranks with the same tp, cp and pp rank, holding the same shard; gradients
are averaged over it. ``DP_GROUP``: ranks with the same pp rank; the TP group is a subset of it,
because with ``prescaled_batch`` false each TP rank brings its own batch. ``MP_GROUP``: the ranks
that together hold one model copy (tp x pp). ``PP_GROUP``: ranks with the same tp, rdp and cp
rank: one per pipeline stage. ``CP_GROUP`` (SageMaker v2): ranks splitting the same sequences,
with the same tp, rdp and pp rank. ``DP_CP_GROUP`` (ours): ranks holding the same parameters,
with the same tp and pp rank (rdp x cp): gradients are averaged, and FSDP shards, over it, as
torchtitan's ``dp_shard_cp`` does. Every group is "the ranks that differ from this one only along
these dimensions" (``GROUP_DIMS``), numbered in global-rank order as torch numbers a group.

Expert parallelism is carved out of the data-parallel ranks, as torchtitan and Megatron-Core do:
``Runtime.expert_mesh`` is the world mesh with "dp" split into ``("edp", "ep")``. ``EP_GROUP``:
consecutive data-parallel ranks (same tp, cp and pp rank) that together hold one copy of every
MoE layer's experts, each 1/ep of them; ``EDP_GROUP``: the ranks holding the same experts (same
ep rank), over which expert gradients are averaged.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from enum import Enum
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .compat import flatten_mesh, unflatten_mesh
from .config import Config, build_config, without_effect
from .config_keys import PLACEMENTS
from . import meshes

logger = logging.getLogger("modelparallel")


class CommGroup(str, Enum):
    """SageMaker's communication groups; plain strings ("tp", "rdp"...) are accepted too."""

    WORLD = "world"
    DP_GROUP = "dp"
    TP_GROUP = "tp"
    RDP_GROUP = "rdp"
    MP_GROUP = "mp"
    PP_GROUP = "pp"
    EP_GROUP = "ep"
    EDP_GROUP = "edp"
    CP_GROUP = "cp"
    DP_CP_GROUP = "dp_cp"


WORLD, DP_GROUP, TP_GROUP = CommGroup.WORLD, CommGroup.DP_GROUP, CommGroup.TP_GROUP
RDP_GROUP, MP_GROUP, PP_GROUP = CommGroup.RDP_GROUP, CommGroup.MP_GROUP, CommGroup.PP_GROUP
EP_GROUP, EDP_GROUP = CommGroup.EP_GROUP, CommGroup.EDP_GROUP
CP_GROUP, DP_CP_GROUP = CommGroup.CP_GROUP, CommGroup.DP_CP_GROUP

DIMS = ("pp", "dp", "cp", "tp")
"""The world mesh's dimensions, in the order of its axes."""

EXPERT_DIMS = ("pp", "edp", "ep", "cp", "tp")
"""The expert mesh's dimensions: ``DIMS`` with "dp" split into replicas of one expert ("edp")
and the ranks sharing the experts between them ("ep", the inner part: consecutive dp ranks)."""

GROUP_DIMS: dict[CommGroup, tuple[str, ...]] = {
    WORLD: DIMS,
    TP_GROUP: ("tp",),
    PP_GROUP: ("pp",),
    RDP_GROUP: ("dp",),
    DP_GROUP: ("dp", "cp", "tp"),
    MP_GROUP: ("pp", "tp"),
    EP_GROUP: ("ep",),
    EDP_GROUP: ("edp",),
    CP_GROUP: ("cp",),
    DP_CP_GROUP: ("dp", "cp"),
}
"""The mesh dimensions along which a group's members differ from each other (of ``DIMS``, or of
``EXPERT_DIMS`` for the expert groups)."""

_RUNTIME: Runtime | None = None


@dataclass
class Runtime:
    """Everything a distributed job needs to know about where it runs.

    ``models`` and ``optimizers`` record what the job created, newest last, for the API layer
    only (``smp.state.model``, ``@smp.step``, ``save_checkpoint``'s defaults). Internals never
    search them: an optimizer is linked to the models whose parameters it holds when it is
    built, and each model reads its own link.
    """

    config: Config
    world_mesh: DeviceMesh
    """Every rank, with the dimensions ``DIMS``."""
    mesh: DeviceMesh
    """This rank's ``("dp", "tp")`` slice of ``world_mesh``: the ranks of its pipeline stage and
    context slice, the mesh TP and FSDP work on."""
    device: torch.device
    expert_mesh: DeviceMesh | None = None
    """Every rank, with the dimensions ``EXPERT_DIMS`` (``world_mesh`` with "dp" unflattened)."""
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
    checkpoint_saver: Any = None
    """The job's background checkpoint writer (``checkpoint.async_save.AsyncSaver``), made at its
    first asynchronous save."""
    _groups: dict = field(default_factory=dict)
    """Process groups spanning several mesh dimensions, made by ``init`` (every rank at once)."""
    _object_group: Any = None
    mesh_cache: Any = None
    """The meshes built so far in this process (``meshes.MeshCache``), handed to the next ``init``."""

    @property
    def pending_resume(self):
        """The resume still waiting for its model or optimizer, or None."""
        return self.resume if self.resume is not None and self.resume.armed else None

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """This rank's 1-D context-parallel mesh (the ranks splitting its sequences)."""
        return self.world_mesh["cp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D mesh FSDP shards over: the data-parallel ranks, times the context-parallel ones
        when context parallelism is on (they hold the same parameters; the ``dp_cp`` dimension)."""
        if self.world_mesh.size(DIMS.index("cp")) == 1:
            return self.mesh["dp"]
        return flatten_mesh(self.world_mesh["dp", "cp"], "dp_cp")

    @property
    def ep_mesh(self) -> DeviceMesh:
        """This rank's expert-parallel group as a 1-D mesh (experts are sharded over it)."""
        return self.expert_mesh["ep"]

    @property
    def edp_mesh(self) -> DeviceMesh:
        """The ranks holding this rank's experts (expert replicas), as a 1-D mesh."""
        return self.expert_mesh["edp"]

    def _mesh_of(self, dims: tuple[str, ...]) -> DeviceMesh:
        return self.world_mesh if set(dims) <= set(DIMS) else self.expert_mesh

    def group(self, name: str | CommGroup) -> dist.ProcessGroup:
        """The process group for one of ``CommGroup``'s members (or its string value)."""
        mesh = self._mesh_of(GROUP_DIMS[_group_name(name)])
        dims = _spanned(GROUP_DIMS[_group_name(name)], mesh)
        if len(dims) == 1:
            return mesh.get_group(dims[0])
        if set(dims) == set(_spanned(DIMS, self.world_mesh)):
            return dist.group.WORLD
        return self._groups[dims]

    def ranks(self, name: str | CommGroup) -> list[int]:
        """Global ranks of this rank's group ``name``, in group-rank order (ascending)."""
        dims = GROUP_DIMS[_group_name(name)]
        mesh = self._mesh_of(dims)
        return members(mesh.mesh, dims, dist.get_rank(), mesh.mesh_dim_names)

    def object_group(self) -> dist.ProcessGroup | None:
        """The group for object collectives (``all_gather_object``): the world on gloo (None), a
        gloo side group over NCCL, created on first use by every rank (object collectives on
        NCCL need CUDA tensors, and a CPU group keeps them off the GPU stream)."""
        if dist.get_backend() == "gloo":
            return None
        if self._object_group is None:
            self._object_group = dist.new_group(backend="gloo")
        return self._object_group


def _group_name(name: str | CommGroup) -> CommGroup:
    try:
        return CommGroup(name)
    except ValueError:
        raise ValueError(f"unknown group {name!r}; use one of {[g.value for g in CommGroup]}") from None


def _spanned(dims: tuple[str, ...], mesh: DeviceMesh) -> tuple[str, ...]:
    """The dimensions of ``dims`` with more than one rank (those a group actually spans); the
    first one if none has, so a trivial group is a one-rank mesh dimension's group."""
    wide = tuple(d for d in dims if mesh.size(mesh.mesh_dim_names.index(d)) > 1)
    return wide or dims[:1]


def members(grid: torch.Tensor, dims: tuple[str, ...], rank: int, names: tuple[str, ...] = DIMS) -> list[int]:
    """Global ranks of ``grid`` (axes named ``names``: the ``[pp, dp, cp, tp]`` grid by default)
    that differ from ``rank`` only along ``dims``, ascending."""
    where = (grid == rank).nonzero()[0].tolist()
    index = tuple(slice(None) if d in dims else where[i] for i, d in enumerate(names))
    return sorted(grid[index].flatten().tolist())


def _partition(mesh: DeviceMesh, dims: tuple[str, ...]) -> list[list[int]]:
    """Every group spanning ``dims``: the world cut into member lists."""
    seen, groups = set(), []
    for rank in mesh.mesh.flatten().tolist():
        if rank not in seen:
            group = members(mesh.mesh, dims, rank)
            seen.update(group)
            groups.append(group)
    return groups


def _multi_dim_groups(mesh: DeviceMesh) -> dict[tuple[str, ...], dist.ProcessGroup]:
    """Process groups for the groups spanning several (non-trivial) mesh dimensions short of the
    whole world; every rank creates every one of them, in the same order."""
    groups = {}
    for dims in dict.fromkeys(_spanned(d, mesh) for d in GROUP_DIMS.values() if set(d) <= set(DIMS)):
        if len(dims) > 1 and set(dims) != set(_spanned(DIMS, mesh)):
            mine, _ = dist.new_subgroups_by_enumeration(_partition(mesh, dims))
            groups[dims] = mine
    return groups


def _build_meshes(device: torch.device, layout: torch.Tensor, dp: int, ep: int) -> meshes.Meshes:
    """The world mesh, its expert form and its multi-dimension groups (collectives of every rank)."""
    world = DeviceMesh(device.type, layout, mesh_dim_names=DIMS)
    expert = unflatten_mesh(world, "dp", (dp // ep, ep), EXPERT_DIMS[1:3])
    return meshes.Meshes(world, expert, _multi_dim_groups(world))


def _device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _ensure_process_group(timeout: timedelta) -> None:
    """Join the launcher's process group, or make a world of one when run as a plain process."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def mesh_layout(config: Config) -> torch.Tensor:
    """Global ranks arranged as a ``[pp, dp, cp, tp]`` grid according to ``placement_strategy``.

    The strategy is an order of the letters D, P, T, slowest-varying first: "cluster" is "DPT"
    (a TP group on consecutive ranks, so on one node), "spread" is "TPD" (TP ranks strided).
    Context-parallel ranks (C) sit just outside the tensor-parallel ones, as SageMaker v2 lays
    them out: a rank's data-parallel index is its global rank // (tp x cp) under "cluster".
    """
    order = PLACEMENTS.get(config.placement_strategy, config.placement_strategy.upper()).replace("T", "CT")
    sizes = {"D": config.dp_degree, "P": config.pipeline_parallel_degree,
             "C": config.context_parallel_degree, "T": config.tensor_parallel_degree}
    grid = torch.arange(config.world_size).reshape([sizes[c] for c in order])
    return grid.permute([order.index(c) for c in "PDCT"]).contiguous()


def expert_layout(config: Config) -> torch.Tensor:
    """The ``[pp, edp, ep, cp, tp]`` grid: ``mesh_layout`` with the data-parallel axis split into
    replicas (outer) and expert-parallel ranks (inner), so an expert group is consecutive
    data-parallel ranks."""
    ep = config.expert_parallel_degree
    return mesh_layout(config).unflatten(1, (config.dp_degree // ep, ep))


def configure_logging(global_rank: int) -> None:
    """Show the library's INFO lines (what stays replicated, the layout) unless the user has
    configured the ``modelparallel`` logger already."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[modelparallel rank {global_rank}] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def init(config: dict | str | None = None, *, timeout_s: float = 300.0) -> Runtime:
    """Start (or restart) the distributed runtime.

    Args:
        config: a dict, a JSON file path, or None to read ``MODELPARALLEL_CONFIG``.
        timeout_s: collective timeout; a rank that fails makes the others fail within it.

    Returns:
        The runtime handle (also reachable through the module-level rank API).

    Raises:
        ValueError: for any invalid config, before any collective runs.
    """
    global _RUNTIME
    world = int(os.environ.get("WORLD_SIZE", 1)) if not dist.is_initialized() else dist.get_world_size()
    cfg = build_config(config, world)
    if _RUNTIME is not None:
        if _RUNTIME.checkpoint_saver is not None:  # the previous job's save in flight ends first
            try:
                _RUNTIME.checkpoint_saver.wait()
            except Exception as e:  # noqa: BLE001 - that job is over: say what it lost
                logger.error("the previous job's asynchronous checkpoint failed: %s", str(e).splitlines()[0])
        for lock in _RUNTIME.held_locks.values():
            lock.release()
    _ensure_process_group(timedelta(seconds=timeout_s))
    device = _device()
    layout, ep = mesh_layout(cfg), cfg.expert_parallel_degree
    cache = meshes.carried(_RUNTIME.mesh_cache if _RUNTIME is not None else None)
    built = cache.get(device, layout, ep, lambda: _build_meshes(device, layout, cfg.dp_degree, ep))
    world_mesh = built.world
    torch.manual_seed(cfg.random_seed)
    random.seed(cfg.random_seed)
    _RUNTIME = Runtime(config=cfg, world_mesh=world_mesh, mesh=world_mesh["dp", "tp"], device=device,
                       expert_mesh=built.expert, _groups=built.groups, mesh_cache=cache)
    _v2_contract(cfg, _RUNTIME)
    configure_logging(dist.get_rank())
    if dist.get_rank() == 0:
        logger.info("world %d = %s on %s", cfg.world_size,
                    " x ".join(f"{d} {n}" for d, n in zip(DIMS, world_mesh.mesh.shape) if n > 1 or d in ("dp", "tp")),
                    device.type)
        _log_without_effect(without_effect(config))
    return _RUNTIME


def _v2_contract(cfg: Config, rt: Runtime) -> None:
    """What SageMaker v2 scripts get from ``init`` in PyTorch calls they make themselves: the
    data-parallel layout of their own FSDP1 call (the data x context ranks), and
    ``sm_activation_offloading`` through PyTorch's ``offload_wrapper`` (a no-op unless the key is set)."""
    from .activations import offload_wrapper
    from .training import fsdp1_v2

    offload_wrapper.install()
    fsdp1_v2.install()
    fsdp1_v2.configure(fsdp1_v2.Layout(rt.dp_mesh, cfg.tensor_parallel_degree, cfg.hybrid_shard_degree,
                                       rt.edp_mesh))


_LOGGED_KEYS: set[str] = set()


def _log_without_effect(keys: dict[str, Any]) -> None:
    """Say once per process which given keys tune SageMaker machinery that does not exist here."""
    fresh = {k: v for k, v in keys.items() if k not in _LOGGED_KEYS}
    if fresh:
        _LOGGED_KEYS.update(fresh)
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
