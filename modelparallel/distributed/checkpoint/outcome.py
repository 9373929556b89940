"""Which ranks save or load one checkpoint together, and how a failure on one reaches all.

Every step of a v2 save or load that can fail on one rank ends in ``collective_outcome`` over
the group: an all-gather of each rank's error (or payload), after which either every rank
goes on or every rank raises the same error, its first line the first failing rank's message
(which names the file).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ...checkpoint.safety.errors import CheckpointError, cause
from . import stages


class CheckpointSaveError(CheckpointError):
    """A save (or a load: ``CheckpointLoadError``) failed on some rank; raised on every rank of
    its group."""


class CheckpointLoadError(CheckpointSaveError):
    """A load failed on some rank; raised on every rank of the loading group."""


@dataclass
class Group:
    """The ranks saving one checkpoint together, and which of them coordinates."""

    pg: dist.ProcessGroup | None
    coordinator: int
    """The coordinator's global rank."""

    @property
    def members(self) -> list[int]:
        return dist.get_process_group_ranks(self.pg) if self.pg is not None else list(range(dist.get_world_size()))

    @property
    def is_coordinator(self) -> bool:
        return dist.get_rank() == self.coordinator


def group_of(process_group: dist.ProcessGroup | None, coordinator_rank: int) -> Group:
    """``process_group`` with its coordinator, given as a global rank of the group (SageMaker's
    scripts pass ``min(get_global_ranks(group))``).

    Raises:
        ValueError: when ``coordinator_rank`` is not a member, or this rank is not one.
    """
    group = Group(process_group, coordinator_rank)
    members = group.members
    if dist.get_rank() not in members:
        raise ValueError(f"rank {dist.get_rank()} is not in the process group it saves or loads with {members}")
    if coordinator_rank not in members:
        raise ValueError(f"coordinator_rank={coordinator_rank} is not a member of the process group {members} "
                         "(give one of its global ranks, e.g. min(get_global_ranks(group)))")
    stages.check_group(members)
    return group


def collective_outcome(group: Group, error: BaseException | None, what: str, payload=None,
                       kind: type = None) -> list:
    """Raise on every rank of ``group`` if ``error`` happened on any (a collective); else every
    rank's ``payload``. The message leads with the first failing rank's error (naming its file),
    then every distinct error with the ranks that had it."""
    outcomes: list = [None] * len(group.members)
    root = cause(error) if error is not None else None
    mine = None if root is None else f"{type(root).__name__}: {root}"
    dist.all_gather_object(outcomes, (mine, payload), group=group.pg)
    failed = [(rank, e) for rank, (e, _) in zip(group.members, outcomes) if e is not None]
    if failed:
        by_error: dict[str, list[int]] = {}
        for rank, e in failed:
            by_error.setdefault(e, []).append(rank)
        lines = "\n  ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {e}" for e, rs in by_error.items())
        lead = failed[0][1].splitlines()[0]
        raise (kind or CheckpointSaveError)(
            f"{lead} (rank {failed[0][0]}, during {what})\n{what} failed on {len(failed)} of {len(outcomes)} ranks:"
            f"\n  {lines}") from error
    return [p for _, p in outcomes]


def check_coordinators(group: Group, coordinators: list[int], what: str) -> None:
    """Raise on every rank when the ranks of ``group`` named different coordinators
    (``coordinators``: every rank's, as gathered): each would gather the plans itself, and every
    rank would wait in that collective until it timed out.

    Raises:
        CheckpointSaveError: naming ``what`` and each rank's coordinator.
    """
    if len(set(coordinators)) > 1:
        named = dict(zip(group.members, coordinators))
        raise CheckpointSaveError(f"{what}: the ranks name different coordinators (global rank -> coordinator_rank: "
                                  f"{named}); pass the same coordinator_rank on every rank of the process group, e.g. "
                                  "min(get_global_ranks(group))")
