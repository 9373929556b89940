"""Expert-parallel experts inside a user's own FSDP1 call (SageMaker v2 scripts wrap the model
themselves: ``FSDP(model, auto_wrap_policy=..., use_orig_params=...)``, no mesh).

FSDP1 shards every unit over one group and assumes each rank starts from the same values, which
holds for the dense parameters (replicated over the data-parallel ranks) but not for experts:
ranks of one expert-parallel group hold different experts. So the experts modules are taken out
of the user's call (added to its ignored modules) and sharded with FSDP2 (``fully_shard``) over
the ranks holding the same experts (the expert-data-parallel mesh), in the user call's mixed
precision, sharded over every replica or, under ``hybrid_shard_degree``, inside groups of them and
replicated across the groups. Each experts module is then its own FSDP2 root: it gathers its
shards when it runs and reduce-scatters its gradients over its replicas in the backward pass,
while FSDP1 does the same for the rest over every data-parallel rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..compat import unflatten_mesh
from .style import is_expert_parallel


def set_apart(args: dict, hybrid_shard_degree: int, dp_size: int, ep_size: int) -> list[nn.Module]:
    """Add the expert-parallel experts modules of an FSDP1 call's ``module`` to its ignored
    modules (in place); return them.

    Raises:
        NotImplementedError: a ``hybrid_shard_degree`` that cuts expert-parallel groups (neither
            0, 1, the data-parallel degree nor a multiple of ``expert_parallel_degree``).
    """
    experts = [m for m in args["module"].modules() if is_expert_parallel(m)]
    if not experts:
        return []
    check_shard_degree(hybrid_shard_degree, dp_size, ep_size, "hybrid_shard_degree", "FSDP1")
    if args.get("ignored_states") is not None:
        args["ignored_states"] = [*args["ignored_states"], *experts]
    else:
        args["ignored_modules"] = [*(args.get("ignored_modules") or ()), *experts]
    return experts


def check_shard_degree(n: int, dp_size: int, ep: int, key: str, where: str) -> None:
    """Refuse a shard degree ``n`` of ``dp_size`` replicas whose shard groups split
    expert-parallel groups (neither 0, 1, ``dp_size`` nor a multiple of ``ep``).

    Raises:
        NotImplementedError: naming ``key`` and the degrees.
    """
    if ep > 1 and n not in (0, 1, dp_size) and n % ep:
        raise NotImplementedError(
            f"{key}={n} with expert_parallel_degree={ep} under {where}: a shard group that splits "
            f"expert-parallel groups is not implemented; use 0, 1, {dp_size} or a multiple of {ep}")


def shard_degree(dense_shard_degree: int, ep: int) -> int:
    """Ranks per shard group of the experts when the dense parameters' groups have
    ``dense_shard_degree`` (every replica's count when fully sharded): the same share of the
    experts' replicas, ``dense_shard_degree / ep``, at least one (replicated). The one rule that
    FSDP's expert meshes and the replication groups (``training.replication``) both follow."""
    return max(1, dense_shard_degree // ep)


def replica_mesh(replicas: DeviceMesh, hybrid_shard_degree: int, dp_size: int) -> DeviceMesh:
    """The mesh the experts are sharded over, as ``hybrid_shard_degree`` shards the dense
    parameters over their ``dp_size`` replicas (data x context parallel ranks): all the experts'
    replicas (0 or ``dp_size``), or a 2-D (replicate, shard) mesh whose shard groups hold
    ``shard_degree`` consecutive replicas each (one, replicated everywhere, for degree 1 or ep),
    FSDP2's hybrid sharding."""
    if hybrid_shard_degree in (0, dp_size):
        return replicas
    shard = shard_degree(hybrid_shard_degree, dp_size // replicas.size())
    return unflatten_mesh(replicas, replicas.mesh_dim_names[0], (replicas.size() // shard, shard),
                          ("edp_replicate", "edp_shard"))


def shard(experts: list[nn.Module], replicas: DeviceMesh, mixed_precision) -> None:
    """``fully_shard`` each experts module over ``replicas`` (``replica_mesh``) in the precision
    of FSDP1's ``MixedPrecision`` (or None)."""
    policy = MixedPrecisionPolicy()
    if mixed_precision is not None:
        policy = MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype,
                                      reduce_dtype=mixed_precision.reduce_dtype)
    for module in experts:
        fully_shard(module, mesh=replicas, mp_policy=policy)
