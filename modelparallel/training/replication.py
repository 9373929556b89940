"""Which ranks hold the same data (SageMaker v2's ``state.ranker``).

FSDP shards the parameters over the ranks holding the same ones: the data-parallel ranks times
the context-parallel ranks of one pipeline and tensor-parallel position (``Runtime.dp_mesh``,
"dp" x "cp" flattened, "dp" outer). With ``hybrid_shard_degree`` N those R ranks are cut, in that
mesh's order, into R / N shard groups of N consecutive ranks; each group shards the model over
its members and the groups replicate each other. Expert-parallel experts are sharded apart,
over the ranks holding the same experts (same "ep" index), N / ep of those replicas per shard
group (``expert.fsdp1.replica_mesh``): at N = 1 they are replicated only over those ranks.

Two ranks hold the same data exactly when they hold the same shard of every parameter, dense and
expert: those ranks form a *replication group* (who shares one local, per-shard checkpoint,
written by one of them). A rank's *replication rank* is its place in its group in the FSDP
mesh's order, so the ranks of replication rank 0 are one complete copy of the model (the first
shard group; under expert parallelism with N = 1, the first expert-parallel group), who write a
sharded checkpoint.

Everything is computed from the world grid and the config (no communication), so every rank
gets the same answer and may create the groups itself in the same order.
"""

from __future__ import annotations

import torch

from ..runtime import DIMS, Runtime


class Ranker:
    """Replication groups of a running job.

    Args:
        grid: global ranks as the world mesh's ``[pp, dp, cp, tp]`` grid.
        shard_degree: ranks per shard group (``Config.fsdp_shard_degree``: ``hybrid_shard_degree``,
            or all data x context parallel ranks when it is 0).
        expert_degree: ``expert_parallel_degree`` (experts sharded over consecutive "dp" ranks).

    Raises:
        NotImplementedError: expert parallelism together with context parallelism (no layout
            for experts over context-parallel ranks exists to describe).
    """

    def __init__(self, grid: torch.Tensor, shard_degree: int, expert_degree: int = 1):
        cp = grid.shape[DIMS.index("cp")]
        if expert_degree > 1 and cp > 1:
            raise NotImplementedError(f"ranker: expert_parallel_degree {expert_degree} with context_parallel_degree "
                                      f"{cp} is not implemented")
        self.grid, self.shard_degree, self.expert_degree = grid, shard_degree, expert_degree

    @classmethod
    def of(cls, rt: Runtime) -> Ranker:
        return cls(rt.world_mesh.mesh, rt.config.fsdp_shard_degree, rt.config.expert_parallel_degree)

    def _fsdp_ranks(self, rank: int) -> list[int]:
        """The ranks FSDP shards over with ``rank`` (same pp and tp index), in the mesh's order:
        "dp" outer, "cp" inner."""
        p, _, _, t = (self.grid == rank).nonzero()[0].tolist()
        return self.grid[p, :, :, t].flatten().tolist()

    def _key(self, position: int) -> tuple[int, ...]:
        """What a rank at ``position`` of the FSDP ranks holds: its dense shard, and under expert
        parallelism its experts (ep index) and their shard among the replicas holding them."""
        dense = position % self.shard_degree
        if self.expert_degree == 1:
            return (dense,)
        ep = self.expert_degree
        return dense, position % ep, (position // ep) % max(1, self.shard_degree // ep)

    def _ordered_group(self, rank: int) -> list[int]:
        ranks = self._fsdp_ranks(rank)
        key = self._key(ranks.index(rank))
        return [r for k, r in enumerate(ranks) if self._key(k) == key]

    def get_rep_rank(self, global_rank: int | None = None) -> int:
        """The replication rank of ``global_rank`` (default: this rank): which copy of the model
        it belongs to, 0 for the first."""
        rank = self._rank(global_rank)
        return self._ordered_group(rank).index(rank)

    def get_shard_rank(self, global_rank: int | None = None) -> int:
        """The position of ``global_rank`` inside its shard group (FSDP's ``model.rank``)."""
        rank = self._rank(global_rank)
        return self._fsdp_ranks(rank).index(rank) % self.shard_degree

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
