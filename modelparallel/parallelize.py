"""The one place where the parallel dimensions compose, in a fixed order.

``DistributedModel`` (v1) and ``transform`` (v2) both turn a model into this rank's parallel form
here, so every dimension is applied in the same order whichever API the script uses. Each
dimension lives in its own package that takes the model and the mesh it needs, and knows nothing
of the others; this module only orders them:

1. the pipeline split (``pipeline``): at ``pipeline_parallel_degree`` > 1 the model is cut down
   to this rank's stage (its blocks; embeddings on the first, final modules on the last), so
   every later dimension only sees, and only allocates, the stage's modules;
2. tensor parallelism (``tp.walker``): shards each layer over the ``tp`` mesh dimension.

Data parallelism (replica gradient averaging, FSDP) is applied after this by the caller, over
``Runtime.mesh["dp"]``, because the two APIs differ there (v1 wraps it itself, v2 scripts call
FSDP themselves).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from . import pipeline
from .models import pipeline_split_for
from .runtime import PP_GROUP, Runtime
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
    stage = pipeline.split_model(module, rt.config, rt.ranks(PP_GROUP).index(dist.get_rank()),
                                 pipeline_split_for(module))
    if stage is not None and spec is not None:
        spec = pipeline.stage_spec(spec, module)
    return walker.parallelize(module, rt.tp_mesh, spec)
