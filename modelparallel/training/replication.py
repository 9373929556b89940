"""Which ranks hold the same data (SageMaker v2's ``state.ranker``), read from the whole layout.

Every kind of parameter is replicated over the ranks ``meshes.REPLICA_DIMS`` names (one
function, ``meshes.holders``, lists them in the order FSDP numbers them): a dense parameter over
the data x context parallel ranks of its pipeline stage and tensor-parallel rank, an
expert-parallel expert over those of its expert-parallel rank too. FSDP cuts each kind's
replicas, in that order, into shard groups of consecutive ranks: ``hybrid_shard_degree`` N of
them for dense parameters (all when N is 0), ``expert.fsdp1.shard_degree(N, ep)`` for experts;
a rank's shard of a kind is its position modulo that count.

Two ranks hold the same data exactly when they hold the same shard of every kind: those ranks
form a *replication group* (who shares one local, per-shard checkpoint, written by one of them).
A rank's *replication rank* is its place in its group in the FSDP mesh's order, so the ranks of
replication rank 0 are one complete copy of the model (the first shard group; under expert
parallelism with N = 1, the first expert-parallel group), who write a sharded checkpoint.

Everything is computed from the world grid and the config (no communication), so every rank
gets the same answer and may create the groups itself in the same order.
"""

from __future__ import annotations

import torch

from ..expert.fsdp1 import shard_degree as expert_shard_degree
from ..meshes import REPLICA_DIMS, holders
from ..runtime import DIMS, Runtime


class Ranker:
    """Replication groups of a running job.

    Args:
        grid: global ranks as the world mesh's ``[pp, dp, cp, tp]`` grid.
        shard_degree: ranks per shard group (``Config.fsdp_shard_degree``: ``hybrid_shard_degree``,
            or all data x context parallel ranks when it is 0).
        expert_degree: ``expert_parallel_degree`` (experts sharded over consecutive "dp" ranks).
    """

    def __init__(self, grid: torch.Tensor, shard_degree: int, expert_degree: int = 1):
        self.grid, self.shard_degree, self.expert_degree = grid, shard_degree, expert_degree
        dp = grid.shape[DIMS.index("dp")]
        self._expert_grid = grid.unflatten(DIMS.index("dp"), (dp // expert_degree, expert_degree))
        self._degrees = {"dense": shard_degree}
        if expert_degree > 1:
            self._degrees["experts"] = expert_shard_degree(shard_degree, expert_degree)

    @classmethod
    def of(cls, rt: Runtime) -> Ranker:
        return cls(rt.world_mesh.mesh, rt.config.fsdp_shard_degree, rt.config.expert_parallel_degree)

    def _shard_mates(self, rank: int, kind: str) -> set[int]:
        """The ranks holding ``rank``'s shard of the ``kind`` parameters."""
        ranks, n = holders(self._expert_grid, REPLICA_DIMS[kind], rank), self._degrees[kind]
        mine = ranks.index(rank) % n
        return {r for k, r in enumerate(ranks) if k % n == mine}

    def _ordered_group(self, rank: int) -> list[int]:
        """The ranks holding the same shard of every kind as ``rank``, in the FSDP mesh's order."""
        same = [self._shard_mates(rank, kind) for kind in self._degrees]
        return [r for r in holders(self._expert_grid, REPLICA_DIMS["dense"], rank) if all(r in s for s in same)]

    def get_rep_rank(self, global_rank: int | None = None) -> int:
        """The replication rank of ``global_rank`` (default: this rank): which copy of the model
        it belongs to, 0 for the first."""
        rank = self._rank(global_rank)
        return self._ordered_group(rank).index(rank)

    def get_shard_rank(self, global_rank: int | None = None) -> int:
        """The position of ``global_rank`` inside its shard group (FSDP's ``model.rank``)."""
        rank = self._rank(global_rank)
        return holders(self._expert_grid, REPLICA_DIMS["dense"], rank).index(rank) % self.shard_degree

    def get_rep_group(self, global_rank: int | None = None) -> list[int]:
        """Global ranks holding the same data as ``global_rank``, ascending."""
        return sorted(self._ordered_group(self._rank(global_rank)))

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
        return f"Ranker(mesh={shape}, shard_degree={self.shard_degree}, expert_degree={self.expert_degree})"
