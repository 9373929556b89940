"""Which ranks hold the same shard of the model (SageMaker v2's ``state.ranker``).

Under FSDP with ``hybrid_shard_degree`` N, the D data-parallel ranks of one tensor-parallel
position are cut into D / N groups of N consecutive ranks; each group shards the model over its
N members and the groups replicate each other. Two ranks hold the same data exactly when they
have the same pipeline, context and tensor-parallel coordinates and the same position inside
their shard group: those ranks form a *replication group*. A rank's *replication rank* is the
index of its shard group (0 for the first), so "replication rank 0" picks one complete copy of
the model, which is who writes a sharded checkpoint; a replication group is who shares one
local (per-shard) checkpoint, written by one of them.

Everything is computed from the world grid and the config (no communication), so every rank
gets the same answer and may create the groups itself in the same order.
"""

from __future__ import annotations

import torch

from ..runtime import DIMS, Runtime, members

SHARD_DIMS = ("dp",)
"""The mesh dimensions FSDP shards (and hybrid sharding replicates) along."""


class Ranker:
    """Replication groups of a running job.

    Args:
        grid: global ranks as the world mesh's ``[pp, dp, cp, tp]`` grid.
        shard_degree: ranks per shard group (``Config.fsdp_shard_degree``: ``hybrid_shard_degree``,
            or all data-parallel ranks when it is 0).
    """

    def __init__(self, grid: torch.Tensor, shard_degree: int):
        self.grid = grid
        self.shard_degree = shard_degree

    @classmethod
    def of(cls, rt: Runtime) -> Ranker:
        return cls(rt.world_mesh.mesh, rt.config.fsdp_shard_degree)

    def _fsdp_ranks(self, rank: int) -> list[int]:
        return members(self.grid, SHARD_DIMS, rank)

    def get_rep_rank(self, global_rank: int | None = None) -> int:
        """The replication rank of ``global_rank`` (default: this rank): which copy of the model
        (shard group) it belongs to, 0 for the first."""
        rank = self._rank(global_rank)
        return self._fsdp_ranks(rank).index(rank) // self.shard_degree

    def get_shard_rank(self, global_rank: int | None = None) -> int:
        """The position of ``global_rank`` inside its shard group (FSDP's ``model.rank``)."""
        rank = self._rank(global_rank)
        return self._fsdp_ranks(rank).index(rank) % self.shard_degree

    def get_rep_group(self, global_rank: int | None = None) -> list[int]:
        """Global ranks holding the same shard as ``global_rank``, ascending."""
        rank = self._rank(global_rank)
        ranks = self._fsdp_ranks(rank)
        return ranks[ranks.index(rank) % self.shard_degree::self.shard_degree]

    def get_rep_groups(self) -> list[list[int]]:
        """Every replication group of the job, each ascending, in the order of their lowest rank
        (the same list on every rank)."""
        seen, groups = set(), []
        for rank in sorted(self.grid.flatten().tolist()):
            if rank not in seen:
                group = self.get_rep_group(rank)
                seen.update(group)
                groups.append(group)
        return groups

    def _rank(self, global_rank: int | None) -> int:
        if global_rank is None:
            import torch.distributed as dist

            return dist.get_rank()
        if not (self.grid == global_rank).any():
            raise ValueError(f"ranker: rank {global_rank} is not in this job's {self.grid.numel()} ranks")
        return int(global_rank)

    def __repr__(self) -> str:
        shape = dict(zip(DIMS, self.grid.shape))
        return f"Ranker(mesh={shape}, shard_degree={self.shard_degree})"
