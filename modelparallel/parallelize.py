"""The one place where the parallel dimensions compose, in a fixed order.

``DistributedModel`` (v1) and ``transform`` (v2) both turn a model into this rank's parallel form
here, so every dimension is applied in the same order whichever API the script uses. Each
dimension lives in its own package that takes the model and the mesh it needs, and knows nothing
of the others; this module only orders them:

1. tensor parallelism (``tp.walker``): shards each layer over the ``tp`` mesh dimension.

Data parallelism (replica gradient averaging, FSDP) is applied after this by the caller, over
``Runtime.mesh["dp"]``, because the two APIs differ there (v1 wraps it itself, v2 scripts call
FSDP themselves).
"""

from __future__ import annotations

from torch import nn

from .runtime import Runtime
from .tp import walker
from .tp.plan import ArchSpec


def parallelize(module: nn.Module, rt: Runtime, spec: ArchSpec | None) -> list[str]:
    """Apply every model-parallel dimension the runtime asks for to ``module``, in place.

    Args:
        module: the model (real or on the meta device).
        rt: the running job (its config and meshes).
        spec: the architecture's plan, or None for a model the walker handles from its marks.

    Returns:
        Paths of the modules left replicated over the tensor-parallel ranks (for the log line).

    Raises:
        ValueError: when a dimension's plan does not fit the model, before any tensor is touched.
    """
    return walker.parallelize(module, rt.tp_mesh, spec)
