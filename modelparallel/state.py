"""``smp.state``: one object answering SageMaker v1's and v2's questions about the running job.

v1 scripts read ``smp.state.cfg``, ``smp.state.model``, ``smp.state.optimizer``; v2 scripts read
``state.tp_rank``, ``state.dp_rank``, ``state.tensor_parallel_degree``... Every attribute is read
from the runtime started by ``init`` at the moment it is asked for.

``dp_rank``/``dp_size`` here follow v2, where tensor-parallel ranks share a batch: they count
replicas of one model copy (v1's ``rdp_rank()``/``rdp_size()``). v1's functions ``smp.dp_rank()``
and ``smp.dp_size()`` keep v1's meaning (the TP group inside the data-parallel group).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from . import runtime


class _State:
    """Attributes of the running job; see the module docstring."""

    @property
    def initialized(self) -> bool:
        return runtime.is_initialized()

    @property
    def cfg(self):
        return runtime.current().config

    config = cfg

    @property
    def model(self):
        models = runtime.current().models
        return models[-1] if models else None

    @property
    def optimizer(self):
        optimizers = runtime.current().optimizers
        return optimizers[-1] if optimizers else None

    @property
    def rank(self) -> int:
        return runtime.rank()

    @property
    def world_size(self) -> int:
        return runtime.size()

    size = world_size

    @property
    def local_rank(self) -> int:
        return runtime.local_rank()

    @property
    def tp_rank(self) -> int:
        return runtime.tp_rank()

    @property
    def tp_size(self) -> int:
        return runtime.tp_size()

    @property
    def dp_rank(self) -> int:
        return runtime.rdp_rank()

    @property
    def dp_size(self) -> int:
        return runtime.rdp_size()

    rdp_rank, rdp_size = dp_rank, dp_size

    @property
    def pp_rank(self) -> int:
        return runtime.pp_rank()

    @property
    def pp_size(self) -> int:
        return runtime.pp_size()

    @property
    def cp_rank(self) -> int:
        runtime.current()
        return 0

    ep_rank = cp_rank

    @property
    def cp_size(self) -> int:
        return runtime.current().config.context_parallel_degree

    @property
    def ep_size(self) -> int:
        return runtime.current().config.expert_parallel_degree

    @property
    def tensor_parallel_degree(self) -> int:
        return runtime.current().config.tensor_parallel_degree

    @property
    def hybrid_shard_degree(self) -> int:
        return runtime.current().config.hybrid_shard_degree

    @property
    def sm_activation_offloading(self) -> bool:
        return runtime.current().config.activation_offloading

    @property
    def activation_loading_horizon(self) -> int:
        return runtime.current().config.activation_loading_horizon

    @property
    def world_process_group(self) -> dist.ProcessGroup:
        return runtime.get_world_process_group()

    @property
    def tp_process_group(self) -> dist.ProcessGroup:
        return runtime.get_tp_process_group()

    @property
    def dp_process_group(self) -> dist.ProcessGroup:
        """v2's data-parallel group: the ranks holding the same shard."""
        return runtime.get_rdp_process_group()

    @property
    def device_mesh(self):
        """The [rdp ("dp"), tp] DeviceMesh."""
        return runtime.current().mesh

    @property
    def local_size(self) -> int:
        runtime.current()
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def __repr__(self) -> str:
        if not runtime.is_initialized():
            return "smp.state(not initialized)"
        return (f"smp.state(rank={self.rank}, world_size={self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"dp(v2)={self.dp_rank}/{self.dp_size})")


state = _State()
