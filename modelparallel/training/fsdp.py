"""Sharded data parallelism composed with TP: PyTorch FSDP2 (``fully_shard``) over the "dp" mesh.

After the TP walker, each parameter is a DTensor on the "tp" dim of the runtime's 2-D
("dp", "tp") mesh; ``fully_shard`` over the "dp" dim shards it further, so parameters, gradients
and optimizer state are split over all ``dp x tp`` ranks (SageMaker's
``sharded_data_parallel_degree`` / ``hybrid_shard_degree``). Each transformer block is its own
FSDP group (all-gathered just before use, freed after), then the root takes the rest. FSDP
averages gradients over "dp" by reduce-scatter, so ``DistributedModel.backward`` skips its own
all-reduce.

Experts sharded by expert parallelism (DTensors on the "ep" dimension) are replicated only over
the ranks holding the same experts: each experts module is its own FSDP group over that
expert-data-parallel mesh, applied before the blocks, which then leave its parameters alone.

A shard degree N below the replicas' count (hybrid sharding: shard inside groups of N
consecutive replicas, replicate across the groups) shards over FSDP2's 2-D ("replicate", "shard")
mesh, the replica mesh unflattened (``Topology.sharding_meshes``): it shares the world mesh with
"tp", so TP's DTensors are sharded further as under full sharding, per tp coordinate.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..expert import is_expert_parallel
from ..expert.fsdp1 import check_shard_degree
from ..tp.layout import base_prefix
from ..tp.plan import ArchSpec, block_prefix, glob_match, join


def block_modules(module: nn.Module, spec: ArchSpec | None) -> list[nn.Module]:
    """The repeated blocks of ``module``'s plan (``layers.*``, ``h.*``...), in model order."""
    if spec is None:
        return []
    prefix = base_prefix(module)
    globs = {join(prefix, b) for b in map(block_prefix, spec.base.rules) if b}
    globs |= {b for b in map(block_prefix, spec.head.rules) if b}
    return [m for path, m in module.named_modules() if path and any(glob_match(g, path) for g in globs)]


def check_degree(shard_degree: int, replicas: int, ep: int) -> None:
    """Refuse, before any collective, a shard degree whose groups split expert-parallel groups.

    Raises:
        NotImplementedError: naming the degrees.
    """
    check_shard_degree(shard_degree, replicas, ep, "sharded data parallel degree", "DistributedModel's FSDP")


def mixed_precision(compute_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """fp16/bf16 training under FSDP: the sharded parameters stay fp32 (they are the master
    weights the optimizer steps, so it needs no copies of its own), each block is all-gathered
    in ``compute_dtype`` for forward and backward, and gradients are reduced in fp32."""
    if compute_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def shard_data_parallel(module: nn.Module, dp_mesh, spec: ArchSpec | None, shard_degree: int,
                        mp_policy: MixedPrecisionPolicy | None = None, keep_gathered: bool = False,
                        expert_replicas=None) -> bool:
    """Apply FSDP2 over ``dp_mesh`` (the data-parallel ranks, times the context-parallel ones
    when context parallelism is on; 2-D for hybrid sharding: ``Topology.sharding_meshes``) to
    each block of ``module`` and to the root, when ``shard_degree`` > 1, with ``mp_policy``
    (default: compute in the parameters' dtype); with ``keep_gathered`` each block's parameters
    stay gathered between its forward and its backward (optimizer state and gradients sharded,
    parameters gathered once per step). Expert-parallel experts modules are sharded over
    ``expert_replicas`` (the mesh of the ranks holding the same experts) first. Return whether
    it did."""
    if shard_degree <= 1:
        return False
    policy = mp_policy or MixedPrecisionPolicy()
    for experts in [m for m in module.modules() if is_expert_parallel(m)]:
        fully_shard(experts, mesh=expert_replicas, mp_policy=policy, reshard_after_forward=not keep_gathered)
    for block in block_modules(module, spec):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=not keep_gathered)
    fully_shard(module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=not keep_gathered)
    return True
