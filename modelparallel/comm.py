"""SageMaker's communication API on objects: group member lists, ``send``/``recv_from``,
``broadcast``, ``allgather``, barriers.

Point-to-point messages always travel over the world group (a rank given relative to a group is
translated to its global rank first), so a ``broadcast`` to a group matches a ``recv_from`` that
names the sender with any rank type.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .runtime import CP_GROUP, DP_GROUP, MP_GROUP, PP_GROUP, RDP_GROUP, TP_GROUP, WORLD, CommGroup, current


class RankType(str, Enum):
    """How a rank number passed to ``send``/``recv_from`` is read: relative to which group."""

    WORLD_RANK = "world"
    DP_RANK = "dp"
    TP_RANK = "tp"
    RDP_RANK = "rdp"
    MP_RANK = "mp"
    PP_RANK = "pp"
    CP_RANK = "cp"


def _members(group: CommGroup, name: str, what: str):
    """The getter SageMaker names ``name``: the global ranks of this rank's ``group``."""
    def members() -> list[int]:
        return current().ranks(group)

    members.__name__ = members.__qualname__ = name
    members.__doc__ = f"Global ranks of {what}, in group-rank order."
    return members


get_world_group = _members(WORLD, "get_world_group", "the job")
get_tp_group = _members(TP_GROUP, "get_tp_group", "this rank's tensor-parallel group")
get_dp_group = _members(DP_GROUP, "get_dp_group", "the ranks holding replicas of this rank's model partition")
get_rdp_group = _members(RDP_GROUP, "get_rdp_group", "the ranks holding the same shard as this rank")
get_mp_group = _members(MP_GROUP, "get_mp_group", "the ranks over which this rank's model replica is partitioned")
get_pp_group = _members(PP_GROUP, "get_pp_group", "this rank's pipeline group (one rank per stage)")
get_cp_group = _members(CP_GROUP, "get_cp_group", "the ranks splitting this rank's sequences")


def tp_mesh() -> DeviceMesh:
    """The 1-D tensor-parallel DeviceMesh of this rank."""
    return current().tp_mesh


def dp_mesh() -> DeviceMesh:
    """The 1-D DeviceMesh FSDP shards over: the ranks holding the same shard (SageMaker's rdp
    group), times the context-parallel ranks when ``context_parallel_degree`` > 1 (they hold the
    same parameters too)."""
    return current().replica_mesh


def expert_dp_mesh() -> DeviceMesh:
    """The 1-D DeviceMesh of the ranks holding this rank's experts (same ep rank), which FSDP
    shards an expert-parallel experts module over: the expert-data-parallel ranks, times the
    context-parallel ones when ``context_parallel_degree`` > 1. ``dp_mesh()`` at expert degree 1."""
    return current().expert_replica_mesh


def cp_mesh() -> DeviceMesh:
    """The 1-D context-parallel DeviceMesh of this rank (the ranks splitting its sequences)."""
    return current().cp_mesh


def _global_rank(rank: int, rank_type: RankType | str) -> int:
    members = current().ranks(CommGroup(RankType(rank_type).value))
    if not 0 <= rank < len(members):
        raise ValueError(f"rank {rank} is outside the {RankType(rank_type).name} range 0..{len(members) - 1}")
    return members[rank]


def send(obj: Any, dest_rank: int, rank_type: RankType | str = RankType.WORLD_RANK) -> None:
    """Send a picklable object to ``dest_rank`` (read relative to ``rank_type``'s group); returns
    once the receiver has called ``recv_from``."""
    dist.send_object_list([obj], dst=_global_rank(dest_rank, rank_type))


def recv_from(src_rank: int, rank_type: RankType | str = RankType.WORLD_RANK) -> Any:
    """Receive the object a peer sent with ``send`` or ``broadcast``."""
    box = [None]
    dist.recv_object_list(box, src=_global_rank(src_rank, rank_type))
    return box[0]


def broadcast(obj: Any, group: CommGroup | str = WORLD) -> None:
    """Send ``obj`` to every other rank of this rank's ``group``; only the sender calls this,
    each receiver calls ``recv_from(sender)``."""
    me = dist.get_rank()
    for peer in current().ranks(group):
        if peer != me:
            dist.send_object_list([obj], dst=peer)


def allgather(obj: Any, group: CommGroup | str = WORLD) -> list[Any]:
    """Every rank of ``group`` submits an object; each gets the list, indexed by group rank."""
    out: list[Any] = [None] * len(current().ranks(group))
    dist.all_gather_object(out, obj, group=current().group(group))
    return out


def barrier(group: CommGroup | str = WORLD) -> None:
    """Wait until every rank of ``group`` arrives."""
    dist.barrier(group=current().group(group))


def dp_barrier() -> None:
    barrier(DP_GROUP)


def mp_barrier() -> None:
    barrier(MP_GROUP)
