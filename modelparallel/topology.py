"""Where a job runs: its config, device, meshes and process groups, fixed when ``init`` returns.

``Topology`` is what the engine is given to compose a model (``parallelize``) and to give its
shards values (``materialize``): it changes only when ``init`` starts another job, so it is
frozen. What a job accumulates while it runs (its models, optimizers, the running step, a
pending resume) is ``runtime.Runtime``'s.

"dp" names one thing here: the world mesh's "dp" dimension, SageMaker's reduced-data-parallel
(rdp) ranks (same tp, cp and pp rank). The ranks that hold the same parameters, data times
context parallel, are the *replicas* (``replica_mesh``, ``Config.replica_degree``); SageMaker's
``DP_GROUP`` (ranks with the same pp rank) is a group name of ``meshes``, not a mesh here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import meshes
from .compat import default_group_timeout, flatten_mesh, unflatten_mesh
from .config import Config
from .expert.fsdp1 import replica_mesh as expert_mesh
from .meshes import DIMS, GROUP_DIMS, REPLICA_DIMS, CommGroup, members, spanned


@dataclass(frozen=True)
class Topology:
    """The job's config, device, meshes and process groups (read-only once built)."""

    config: Config
    world_mesh: DeviceMesh
    """Every rank, with the dimensions ``DIMS`` ("pp", "dp", "cp", "tp")."""
    mesh: DeviceMesh
    """This rank's ``("dp", "tp")`` slice of ``world_mesh``: the ranks of its pipeline stage and
    context slice, the mesh tensor parallelism works on."""
    device: torch.device
    expert_mesh: DeviceMesh | None = None
    """Every rank, with the dimensions ``EXPERT_DIMS`` (``world_mesh`` with "dp" unflattened)."""
    groups: dict = field(default_factory=dict)
    """Process groups spanning several mesh dimensions, made by ``init`` (every rank at once)."""
    mesh_cache: Any = None
    """The meshes and groups built so far in this process (``meshes.MeshCache``), handed to the
    next ``init`` and to the groups made on first use."""

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """This rank's 1-D context-parallel mesh (the ranks splitting its sequences)."""
        return self.world_mesh["cp"]

    @property
    def replica_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the ranks holding this rank's parameters, over which gradients are
        averaged and FSDP shards: the "dp" ranks, times the context-parallel ones when context
        parallelism is on (the ``dp_cp`` dimension). ``smp.dp_mesh()`` returns it."""
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

    @property
    def expert_replica_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the ranks holding this rank's experts, over which expert gradients are
        averaged and FSDP shards experts: the "edp" ranks, times the context-parallel ones when
        context parallelism is on (they split sequences, not experts: ``REPLICA_DIMS``)."""
        if self.world_mesh.size(DIMS.index("cp")) == 1:
            return self.edp_mesh
        return flatten_mesh(self.expert_mesh[REPLICA_DIMS["experts"]], "edp_cp")

    def sharding_meshes(self, shard_degree: int) -> tuple[DeviceMesh, DeviceMesh]:
        """The meshes FSDP shards dense parameters and expert-parallel experts over at
        ``shard_degree`` ranks per shard group: the replica meshes themselves when it is all of
        them, else each unflattened into FSDP's 2-D hybrid ("replicate", "shard") mesh of shard
        groups of consecutive replicas (``expert.fsdp1.replica_mesh`` for the experts). Both
        share the world mesh with the "tp" dimension, so FSDP shards TP's DTensors further.
        Made once per layout and degree (``mesh_cache``)."""
        dense, experts, n = self.replica_mesh, self.expert_replica_mesh, shard_degree
        if n >= dense.size():
            return dense, experts
        return meshes.kept(self.mesh_cache, ("hybrid sharding", meshes.layout_key(self.expert_mesh), n),
                           lambda: (unflatten_mesh(dense, dense.mesh_dim_names[0], (dense.size() // n, n),
                                                   ("replicate", "shard")),
                                    expert_mesh(experts, n, dense.size())))

    def _mesh_of(self, dims: tuple[str, ...]) -> DeviceMesh:
        return self.world_mesh if set(dims) <= set(DIMS) else self.expert_mesh

    def group(self, name: str | CommGroup) -> dist.ProcessGroup:
        """The process group for one of ``CommGroup``'s members (or its string value)."""
        mesh = self._mesh_of(GROUP_DIMS[group_name(name)])
        dims = spanned(GROUP_DIMS[group_name(name)], mesh)
        if len(dims) == 1:
            return mesh.get_group(dims[0])
        if set(dims) == set(spanned(DIMS, self.world_mesh)):
            return dist.group.WORLD
        return self.groups[dims]

    def ranks(self, name: str | CommGroup) -> list[int]:
        """Global ranks of this rank's group ``name``, in group-rank order (ascending)."""
        dims = GROUP_DIMS[group_name(name)]
        mesh = self._mesh_of(dims)
        return members(mesh.mesh, dims, dist.get_rank(), mesh.mesh_dim_names)

    def object_group(self) -> dist.ProcessGroup | None:
        """The group for object collectives (``all_gather_object``): the world on gloo (None), a
        gloo side group over NCCL, created on first use by every rank (object collectives on
        NCCL need CUDA tensors, and a CPU group keeps them off the GPU stream) and kept in
        ``mesh_cache`` for the jobs after this one."""
        if dist.get_backend() == "gloo":
            return None
        return meshes.kept(self.mesh_cache, ("object collectives", "gloo"),
                           lambda: dist.new_group(backend="gloo", timeout=default_group_timeout()))


def group_name(name: str | CommGroup) -> CommGroup:
    """``name`` as a ``CommGroup``; a ``ValueError`` listing the known names otherwise."""
    try:
        return CommGroup(name)
    except ValueError:
        raise ValueError(f"unknown group {name!r}; use one of {[g.value for g in CommGroup]}") from None
