"""Expert parallelism: each rank of an expert-parallel group holds 1/ep of every MoE layer's
experts, and tokens travel to their experts' ranks and back (dropless all-to-all, or all-gather).

- ``layout``: ``ExpertLayout``, where an architecture keeps its experts and router (data, given
  by ``models/<arch>.py``).
- ``style``: ``ExpertParallel``, the parallel style sharding an experts module on the expert
  dimension, and its dispatching forward.
- ``dispatch``: the token dispatchers and their autograd collectives.
- ``tensor_parallel``: expert tensor parallelism (``expert_tensor_parallel``): each expert's
  weights split over the tensor-parallel ranks too, and the all-to-all pairing its gate and up
  features.
- ``routing``: ``MoEConfig``'s routing options (auxiliary loss, Sinkhorn, z-loss).
- ``parallelize``: checks a model against its layout and applies all of the above.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .layout import ExpertLayout
from .parallelize import ExpertWork, apply_experts, check_experts
from .style import ExpertParallel, is_expert_parallel

EP_DIM = "ep"


def is_expert_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is sharded over the expert-parallel mesh dimension (its replicas are the
    ranks with the same ep rank, not every data-parallel rank)."""
    return isinstance(p, DTensor) and EP_DIM in (p.device_mesh.mesh_dim_names or ())


__all__ = ["EP_DIM", "ExpertLayout", "ExpertParallel", "is_expert_parallel", "is_expert_parameter",
           "ExpertWork", "apply_experts", "check_experts"]
