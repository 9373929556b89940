"""``get_global_ranks``: the members of a process group, as global ranks (SageMaker v2's
``torch.sagemaker.utils.process_group_utils``)."""

from __future__ import annotations

import torch.distributed as dist


def get_global_ranks(process_group: dist.ProcessGroup | None = None) -> list[int]:
    """Global ranks of ``process_group`` (default: the world), in group-rank order.

    Scripts take ``min(get_global_ranks(model.process_group))`` as the coordinator of a
    checkpoint written by an FSDP group.

    Raises:
        ValueError: when this rank is not a member of ``process_group`` (no rank outside a group
            can list it).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"get_global_ranks: rank {dist.get_rank()} is not a member of the process group it was given")
    return dist.get_process_group_ranks(group)
