"""Expert-parallel experts inside a user's own FSDP1 call (SageMaker v2 scripts wrap the model
themselves: ``FSDP(model, auto_wrap_policy=..., use_orig_params=...)``, no mesh).

FSDP1 shards every unit over one group and assumes each rank starts from the same values, which
holds for the dense parameters (replicated over the data-parallel ranks) but not for experts:
ranks of one expert-parallel group hold different experts. So the experts modules are taken out
of the user's call (added to its ignored modules) and sharded with FSDP2 (``fully_shard``) over
the ranks holding the same experts (the expert-data-parallel mesh), in the user call's mixed
precision. Each experts module is then its own FSDP2 root: it gathers its shards when it runs
and reduce-scatters its gradients over its replicas in the backward pass, while FSDP1 does the
same for the rest over every data-parallel rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .style import is_expert_parallel


def set_apart(args: dict, hybrid_shard_degree: int, dp_size: int) -> list[nn.Module]:
    """Add the expert-parallel experts modules of an FSDP1 call's ``module`` to its ignored
    modules (in place); return them.

    Raises:
        NotImplementedError: ``hybrid_shard_degree`` other than 0 or the data-parallel degree
            (hybrid sharding of the expert replicas is not built).
    """
    experts = [m for m in args["module"].modules() if is_expert_parallel(m)]
    if not experts:
        return []
    if hybrid_shard_degree not in (0, dp_size):
        raise NotImplementedError(
            f"hybrid_shard_degree={hybrid_shard_degree} with expert parallelism under FSDP1 (hybrid sharding of "
            f"the expert replicas) is not implemented; use 0 or the data-parallel degree {dp_size}")
    if args.get("ignored_states") is not None:
        args["ignored_states"] = [*args["ignored_states"], *experts]
    else:
        args["ignored_modules"] = [*(args.get("ignored_modules") or ()), *experts]
    return experts


def shard(experts: list[nn.Module], replicas: DeviceMesh, mixed_precision) -> None:
    """``fully_shard`` each experts module over ``replicas`` in the precision of FSDP1's
    ``MixedPrecision`` (or None)."""
    policy = MixedPrecisionPolicy()
    if mixed_precision is not None:
        policy = MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype,
                                      reduce_dtype=mixed_precision.reduce_dtype)
    for module in experts:
        fully_shard(module, mesh=replicas, mp_policy=policy)
