"""The world mesh and its process groups: its dimensions, SageMaker's groups, how ranks are laid out.

The world mesh has one named dimension per kind of parallelism, ``("pp", "dp", "cp", "tp")``
(pipeline stages, reduced data parallelism, context parallelism, tensor parallelism); a degree of
1 gives a dimension of size 1. "dp" is SageMaker's rdp here, nothing else: the ranks that hold
the same shard. ``Topology.mesh`` is the world mesh's ``("dp", "tp")`` slice holding this rank:
the ranks of one pipeline stage and one context slice, the mesh TP works on; FSDP works on
``Topology.replica_mesh`` ("dp" times "cp").

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
``Topology.expert_mesh`` is the world mesh with "dp" split into ``("edp", "ep")``. ``EP_GROUP``:
consecutive data-parallel ranks (same tp, cp and pp rank) that together hold one copy of every
MoE layer's experts, each 1/ep of them; ``EDP_GROUP``: the ranks holding the same experts (same
ep rank), over which expert gradients are averaged.

Built once per layout: every process group PyTorch creates keeps its threads and sockets (three threads per gloo group)
until the process ends; ``init`` called again (a script that restarts the runtime, a test process
running many jobs) would add a set each time, and the idle gloo threads then wake often enough
to slow a small machine several-fold. So a restart with a layout this process has built before
reuses that layout's meshes. Groups hold no state between collectives: reusing one is the same
as making it again. Every rank calls ``init`` with the same configs in the same order, so every
rank builds (a collective) or reuses at the same calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .compat import default_group_timeout, mesh_group_config, unflatten_mesh
from .config import Config
from .config_keys import PLACEMENTS


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

REPLICA_DIMS = {"dense": ("edp", "ep", "cp"), "experts": ("edp", "cp")}
"""Along which ``EXPERT_DIMS`` the ranks holding the same unsharded tensor differ, per kind of
parameter: a dense one is replicated over every data-parallel and context-parallel rank of its
pipeline stage and tensor-parallel rank; an expert-parallel expert only over those of its
expert-parallel rank (context-parallel ranks split sequences, not experts, so they hold the same
experts). FSDP shards each kind over these ranks; ``training.replication`` reads replication
groups from them."""

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


@dataclass(frozen=True)
class Meshes:
    """What ``init`` builds for one layout."""

    world: DeviceMesh
    expert: DeviceMesh
    groups: dict
    """Process groups spanning several mesh dimensions (see ``multi_dim_groups``)."""


@dataclass
class MeshCache:
    """The meshes built over one default process group, by layout; handed from each runtime to
    the next (the distributed context is passed along, not kept in a module)."""

    world_group: Any
    built: dict = field(default_factory=dict)

    def get(self, device: torch.device, layout: torch.Tensor, expert_degree: int,
            build: Callable[[], Meshes]) -> Meshes:
        key = (device.type, tuple(layout.shape), tuple(layout.flatten().tolist()), expert_degree)
        return self.keep(key, build)

    def keep(self, key: tuple, build: Callable[[], Any]) -> Any:
        """What ``build`` makes (a mesh or group other layers create: a pipeline's tied-weight
        pairs, FSDP1's hybrid mesh), made once per ``key``: what it is and the ranks of every
        group it creates. Every rank asks for the same keys in the same order, so every rank
        builds (a collective) or reuses at the same calls."""
        if key not in self.built:
            self.built[key] = build()
        return self.built[key]


def layout_key(mesh: DeviceMesh) -> tuple:
    """What identifies the layout ``mesh`` (the expert mesh: world layout and expert degree) was
    built for, in a ``MeshCache`` key: a mesh derived from one layout's world mesh (flattened,
    unflattened) shares its root, and FSDP composes with TP's or EP's DTensors only over meshes
    of one root, so such a mesh is reused only for the same layout."""
    return mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())


def kept(cache: MeshCache | None, key: tuple, build: Callable[[], Any]) -> Any:
    """``cache.keep(key, build)``, or ``build()`` without a cache (a layer used on its own)."""
    return build() if cache is None else cache.keep(key, build)


def carried(previous: MeshCache | None) -> MeshCache:
    """``previous`` while the default process group is still the one it was built over (a
    destroyed and re-created world makes every group of the old one unusable), else a new one."""
    if previous is not None and previous.world_group is dist.group.WORLD:
        return previous
    return MeshCache(dist.group.WORLD)


def background_group(cache: MeshCache | None) -> dist.ProcessGroup:
    """The gloo group the asynchronous checkpoint writer's collectives run on, beside the
    training thread's (a collective from another thread on the same group could interleave
    with training's), made once per ``cache`` (a collective: call it on every rank).

    ``init`` makes it at start-up when the world has more than one rank: a group made later, in
    the middle of training, is a moment where a rank that dies leaves the others in gloo's
    connect, which retries for several times the group's timeout before giving up."""
    return kept(cache, ("checkpoint background", "gloo"),
                lambda: dist.new_group(backend="gloo", timeout=default_group_timeout()))


def spanned(dims: tuple[str, ...], mesh: DeviceMesh) -> tuple[str, ...]:
    """The dimensions of ``dims`` with more than one rank (those a group actually spans); the
    first one if none has, so a trivial group is a one-rank mesh dimension's group."""
    wide = tuple(d for d in dims if mesh.size(mesh.mesh_dim_names.index(d)) > 1)
    return wide or dims[:1]


def members(grid: torch.Tensor, dims: tuple[str, ...], rank: int, names: tuple[str, ...] = DIMS) -> list[int]:
    """Global ranks of ``grid`` (axes named ``names``: the ``[pp, dp, cp, tp]`` grid by default)
    that differ from ``rank`` only along ``dims``, ascending."""
    return sorted(holders(grid, dims, rank, names))


def holders(grid: torch.Tensor, dims: tuple[str, ...], rank: int, names: tuple[str, ...] = EXPERT_DIMS) -> list[int]:
    """Global ranks of ``grid`` that differ from ``rank`` only along ``dims``, in the order a mesh
    flattened over ``dims`` numbers them (``dims`` row-major, in ``names``' order): the order FSDP
    cuts them into shard groups. With ``REPLICA_DIMS``' dimensions, the ranks holding the same
    unsharded tensor as ``rank``."""
    where = (grid == rank).nonzero()[0].tolist()
    index = tuple(slice(None) if d in dims else where[i] for i, d in enumerate(names))
    return grid[index].flatten().tolist()


def partition(mesh: DeviceMesh, dims: tuple[str, ...]) -> list[list[int]]:
    """Every group spanning ``dims``: the world cut into member lists."""
    seen, groups = set(), []
    for rank in mesh.mesh.flatten().tolist():
        if rank not in seen:
            group = members(mesh.mesh, dims, rank)
            seen.update(group)
            groups.append(group)
    return groups


def multi_dim_groups(mesh: DeviceMesh) -> dict[tuple[str, ...], dist.ProcessGroup]:
    """Process groups for the groups spanning several (non-trivial) mesh dimensions short of the
    whole world; every rank creates every one of them, in the same order."""
    groups = {}
    for dims in dict.fromkeys(spanned(d, mesh) for d in GROUP_DIMS.values() if set(d) <= set(DIMS)):
        if len(dims) > 1 and set(dims) != set(spanned(DIMS, mesh)):
            mine, _ = dist.new_subgroups_by_enumeration(partition(mesh, dims), timeout=default_group_timeout())
            groups[dims] = mine
    return groups


def build(device: torch.device, layout: torch.Tensor, dp: int, ep: int) -> Meshes:
    """The world mesh, its expert form and its multi-dimension groups (collectives of every rank)."""
    world = DeviceMesh(device.type, layout, mesh_dim_names=DIMS,
                       backend_override=tuple(mesh_group_config(device.type, n) for n in layout.shape))
    expert = unflatten_mesh(world, "dp", (dp // ep, ep), EXPERT_DIMS[1:3])
    return Meshes(world, expert, multi_dim_groups(world))


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
