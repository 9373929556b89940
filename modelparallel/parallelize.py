"""The one place where the parallel dimensions compose, in a fixed order.

``DistributedModel`` (v1) and ``transform`` (v2) both turn a model into this rank's parallel form
here, so every dimension is applied in the same order whichever API the script uses. Each
dimension lives in its own package that takes the model and the mesh it needs, and knows nothing
of the others; this module only orders them:

1. the pipeline split (``pipeline``): at ``pipeline_parallel_degree`` > 1 the model is cut down
   to this rank's stage (its blocks; embeddings on the first, final modules on the last), so
   every later dimension only sees, and only allocates, the stage's modules;
2. tensor parallelism (``tp.walker``): shards each layer over the ``tp`` mesh dimension (with the
   ``sequence_parallel`` key, the hidden states between its regions split over it too);
3. expert parallelism (``expert``): shards each MoE layer's experts over the ``ep`` dimension
   (data-parallel ranks sharing the experts) and applies a ``MoEConfig``'s routing options;
4. context parallelism (``context``): splits every sequence over the ``cp`` mesh dimension
   (attention reaches the other ranks' keys and values; the weights are not split);
5. whenever the tensor-parallel walker ran, every parameter still a plain tensor becomes a
   ``Replicate()`` DTensor on the ``tp`` mesh (``tp.dtensor_params``), so that torch's
   ``foreach`` and ``fused`` optimizers never see plain tensors beside DTensors.

Data parallelism (replica gradient averaging, FSDP) is applied after this by the caller, over
``Runtime.dp_mesh`` (the data-parallel ranks, times the context-parallel ones: they hold the
same weights), because the two APIs differ there (v1 wraps it itself, v2 scripts call FSDP
themselves).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from . import context, pipeline
from .expert import apply_experts, check_experts
from .models import BUILT_IN, architecture_for
from .moe.moe_config import MoEConfig
from .pipeline.split import hf_pipeline_split
from .runtime import PP_GROUP, Runtime
from .tp import walker
from .tp.dtensor_params import replicate_plain_parameters
from .tp.plan import ArchSpec


def check(module: nn.Module, rt: Runtime, cp_comm_type: str = "p2p", moe: MoEConfig | None = None) -> None:
    """Refuse, before any collective, a model a dimension cannot run whatever its weights (an
    encoder under context parallelism, an unknown ``cp_comm_type``, a MoE model whose experts the
    expert-parallel degree cannot split or whose layout is unknown, context or expert parallelism
    with pipeline parallelism).

    Raises:
        ValueError, NotImplementedError: naming the model type or the value at fault.
    """
    context.check_comm_type(cp_comm_type)
    pp = rt.config.pipeline_parallel_degree
    for key in ("context_parallel_degree", "expert_parallel_degree"):
        if pp > 1 and getattr(rt.config, key) > 1:
            raise NotImplementedError(f"{key} {getattr(rt.config, key)} with pipeline_parallel_degree {pp} is not "
                                      "implemented; use one of them")
    _expert_work(module, rt, moe)
    if rt.config.context_parallel_degree > 1:
        context.check_model(module, getattr(architecture_for(module), "context", None))


def _expert_work(module: nn.Module, rt: Runtime, moe: MoEConfig | None):
    ep, cp = rt.config.expert_parallel_degree, rt.config.context_parallel_degree
    if ep > 1 and cp > 1:
        raise NotImplementedError(f"expert_parallel_degree {ep} with context_parallel_degree {cp} (experts "
                                  "replicated over context-parallel ranks) is not implemented; use one of them")
    return check_experts(module, ep, getattr(architecture_for(module), "experts", None), moe,
                         tuple(t for t, a in BUILT_IN.items() if a.experts))


def parallelize(module: nn.Module, rt: Runtime, spec: ArchSpec | None, cp_comm_type: str = "p2p",
                moe: MoEConfig | None = None, tensor_parallel: bool = True) -> list[str]:
    """Apply every model-parallel dimension the runtime asks for to ``module``, in place.

    Args:
        module: the model (real or on the meta device).
        rt: the running job (its config and meshes).
        spec: the architecture's plan, or None for a model the walker handles from its marks.
        cp_comm_type: context parallelism's communication, "p2p" or "all_gather".
        moe: SageMaker's ``MoEConfig`` (``transform(model, config=MoEConfig(...))``), or None.
        tensor_parallel: run the TP walker and make every remaining parameter a replicated DTensor
            (``transform`` leaves a plain model at TP degree 1).

    Returns:
        Paths of the modules left replicated over the tensor-parallel ranks (for the log line).

    Raises:
        ValueError, NotImplementedError: when a dimension's plan does not fit the model (or the
            context-parallel communication is unknown), before any tensor is touched.
    """
    check(module, rt, cp_comm_type, moe)  # every dimension is checked before anything is touched
    experts = _expert_work(module, rt, moe)
    record = architecture_for(module)  # a model with no record: transformers' own pipeline plan
    stage = pipeline.split_model(module, rt.config, rt.ranks(PP_GROUP).index(dist.get_rank()),
                                 record.pipeline if record else hf_pipeline_split(module))
    if stage is not None and spec is not None:
        spec = pipeline.stage_spec(spec, module)
    replicated = walker.parallelize(module, rt.tp_mesh, spec, rt.config.sequence_parallel) if tensor_parallel else []
    apply_experts(experts, rt.ep_mesh)
    if rt.config.context_parallel_degree > 1:
        context.parallelize(module, rt.cp_mesh, getattr(architecture_for(module), "context", None), cp_comm_type)
    if tensor_parallel:  # one kind of parameter for torch's foreach and fused optimizers
        replicate_plain_parameters(module, rt.tp_mesh)
    return replicated
