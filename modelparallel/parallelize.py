"""The one place where the parallel dimensions compose, in a fixed order.

``DistributedModel`` (v1) and ``transform`` (v2) both turn a model into this rank's parallel form
here, so every dimension is applied in the same order whichever API the script uses. Each
dimension lives in its own package that takes the model and the mesh it needs, and knows nothing
of the others; this module only orders them:

1. tensor parallelism (``tp.walker``): shards each layer over the ``tp`` mesh dimension.
2. expert parallelism (``expert``): shards each MoE layer's experts over the ``ep`` dimension
   (data-parallel ranks sharing the experts) and applies a ``MoEConfig``'s routing options.

Data parallelism (replica gradient averaging, FSDP) is applied after this by the caller, over
``Runtime.mesh["dp"]``, because the two APIs differ there (v1 wraps it itself, v2 scripts call
FSDP themselves).
"""

from __future__ import annotations

from torch import nn

from .expert import apply_experts, check_experts
from .models import EXPERT_LAYOUTS, experts_for
from .moe.moe_config import MoEConfig
from .runtime import Runtime
from .tp import walker
from .tp.plan import ArchSpec


def parallelize(module: nn.Module, rt: Runtime, spec: ArchSpec | None, moe: MoEConfig | None = None,
                tensor_parallel: bool = True) -> list[str]:
    """Apply every model-parallel dimension the runtime asks for to ``module``, in place.

    Args:
        module: the model (real or on the meta device).
        rt: the running job (its config and meshes).
        spec: the architecture's plan, or None for a model the walker handles from its marks.
        moe: SageMaker's ``MoEConfig`` (``transform(model, config=MoEConfig(...))``), or None.
        tensor_parallel: False skips the TP walker (``transform`` at degree 1 keeps plain tensors).

    Returns:
        Paths of the modules left replicated over the tensor-parallel ranks (for the log line).

    Raises:
        ValueError: when a dimension's plan does not fit the model, before any tensor is touched.
    """
    experts = check_experts(module, rt.config.expert_parallel_degree, experts_for(module), moe,
                            tuple(EXPERT_LAYOUTS))  # every dimension is checked before TP touches anything
    replicated = walker.parallelize(module, rt.tp_mesh, spec) if tensor_parallel else []
    apply_experts(experts, rt.ep_mesh)
    return replicated
