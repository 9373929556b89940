"""The one place where the parallel dimensions compose: ``parallelize`` reads top to bottom.

``DistributedModel`` (v1) and ``transform`` (v2) are thin callers of ``parallelize``, so every
dimension is applied in the same order whichever API the script uses, and the plan choice, the
rank-0 load path and FSDP each happen once, here. Each dimension lives in its own package that
takes the model and the mesh it needs, and knows nothing of the others; this module orders them:

1. check: what no plan or weights can fix (an encoder under context parallelism, an unknown
   ``cp_comm_type``, experts the expert-parallel degree cannot split, a MoE auxiliary loss
   spanning pipeline stages), refused before any collective. What depends on the config
   alone was refused by ``smp.init`` already;
2. plan: the architecture's tensor-parallel plan, or the automatic one;
   then where the weights come from (``materialize.weights``): a model real on rank 0 only goes
   to meta, rank 0 keeping its tensors, so that every rank shards alike without communication;
3. the pipeline split (``pipeline``): at ``pipeline_parallel_degree`` > 1 the model is cut down
   to this rank's stage, so every later dimension only sees, and only allocates, its modules;
4. tensor parallelism (``tp.walker``): shards each layer over the ``tp`` mesh dimension (with
   ``sequence_parallel``, the hidden states between its regions split over it too);
5. expert parallelism (``expert``): shards each MoE layer's experts over the ``ep`` dimension
   (under pipeline parallelism, this stage's layers' experts over the ranks of its stage; with
   ``expert_tensor_parallel``, each expert over ``tp`` too) and applies a ``MoEConfig``'s
   routing options;
6. context parallelism (``context``): splits every sequence over the ``cp`` mesh dimension;
   whenever the walker ran, every parameter still a plain tensor becomes a ``Replicate()``
   DTensor on the ``tp`` mesh, so torch's ``foreach`` and ``fused`` optimizers never see plain
   tensors beside DTensors;
7. materialize: the shards get storage and values (rank 0's, or delayed init);
8. data parallelism: v1 applies FSDP2 over ``Topology.replica_mesh`` (the data-parallel ranks
   times the context-parallel ones: they hold the same weights; its 2-D hybrid form below
   their count, ``Topology.sharding_meshes``) when sharding is configured;
   v2 scripts call FSDP themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import context, pipeline
from .expert import apply_experts, check_experts
from .materialize import creation_options as creation
from .materialize import meta, weights
from .materialize.rank0_sync import move
from .expert.config import MoEConfig
from .meshes import PP_GROUP
from .models import BUILT_IN, architecture_for
from .pipeline.split import hf_pipeline_split
from .topology import Topology
from .tp import auto, walker
from .tp.dtensor_params import replicate_plain_parameters
from .tp.plan import ArchSpec
from .training import fsdp


@dataclass(frozen=True)
class Request:
    """What the calling API asks of ``parallelize``: the two APIs differ only here."""

    api: str
    """Which API calls: "v1" (``DistributedModel``: finds where the weights come from,
    initializes delayed-init models, equalizes replicated parameters, applies FSDP) or "v2"
    (``transform``)."""
    device: torch.device
    dtype: torch.dtype | None = None
    """Floating tensors are cast to it (under v1's FSDP: all-gathered in it for compute)."""
    cp_comm_type: str = "p2p"
    moe: MoEConfig | None = None
    from_rank0: bool = False
    """v2's ``load_state_dict_from_rank0`` (v1 finds a model real on rank 0 only itself)."""
    tensor_parallel: bool = True
    """Run the walker (``transform`` leaves a plain model plain at TP degree 1)."""

    @property
    def v1(self) -> bool:
        return self.api == "v1"


@dataclass
class Parallelized:
    """What ``parallelize`` did, for its caller."""

    spec: ArchSpec | None
    replicated: list[str]
    """Paths of the modules left replicated over the tensor-parallel ranks (for the log line)."""
    pending_meta: bool
    """The model is still on meta, waiting for ``smp.load_hf_checkpoint``."""
    fsdp: bool


def parallelize(module: nn.Module, topo: Topology, ask: Request) -> Parallelized:
    """Apply every parallel dimension the topology asks for to ``module``, in place. A collective.

    Args:
        module: the model, real, on the meta device, or real on rank 0 only (see
            ``materialize.weights``).
        topo: the job's config and meshes.
        ask: what the calling API asks for.

    Raises:
        ValueError, NotImplementedError: when a dimension's plan does not fit the model, before
            any tensor is touched.
        MetaTensorError: ranks whose models mix meta and real tensors in no way a source explains.
    """
    cfg = topo.config
    experts = check(module, topo, ask.cp_comm_type, ask.moe)  # 1. check
    if ask.v1:
        fsdp.check_degree(cfg.shard_degree, cfg.replica_degree, cfg.expert_parallel_degree)
    options = creation.options_of(module) if ask.v1 else None
    spec = plan(module, topo, options)  # 2. plan
    if ask.v1:
        weights.prepare_v1(module, options)
    where = weights.source(module, topo, find=ask.v1, from_rank0=ask.from_rank0)
    full = weights.to_meta_keeping_rank0(module) if where == weights.RANK0 else {}
    # under v1's FSDP the sharded parameters stay fp32 (the master weights); FSDP casts for compute
    move(module, ask.device, None if ask.v1 and cfg.shard_degree > 1 else ask.dtype)
    with meta.torch_parameter_registration():  # v2 scripts may call transform in init_empty_weights()
        stage = pipeline.split_model(module, cfg, topo.ranks(PP_GROUP).index(dist.get_rank()),
                                     _pipeline_split(module))  # 3. pipeline split
        if stage is not None and spec is not None:
            spec = pipeline.stage_spec(spec, module)
        if stage is not None and experts is not None:
            experts = experts.within(module)
        replicated = walker.parallelize(module, topo.tp_mesh, spec, cfg.sequence_parallel) \
            if ask.tensor_parallel else []  # 4. tensor parallelism
        apply_experts(experts, topo.ep_mesh, _ep_tp_mesh(topo, experts))  # 5. expert parallelism
        replicated = experts.still_replicated(replicated) if experts is not None else replicated
        if cfg.context_parallel_degree > 1:  # 6. context parallelism
            context.parallelize(module, topo.cp_mesh, _field(module, "context"), ask.cp_comm_type)
        if ask.tensor_parallel:  # one kind of parameter for torch's foreach and fused optimizers
            replicate_plain_parameters(module, topo.tp_mesh)
    pending = weights.give_values(module, topo, where, full, ask.device,  # 7. materialize
                                  delayed=options is not None and options.delayed, equalize=ask.v1)
    sharded = False
    if ask.v1 and cfg.shard_degree > 1:  # 8. data parallelism
        dense, experts = topo.sharding_meshes(cfg.shard_degree)
        sharded = fsdp.shard_data_parallel(module, dense, spec, cfg.shard_degree, fsdp.mixed_precision(ask.dtype),
                                           keep_gathered=cfg.keep_params_gathered, expert_replicas=experts)
    return Parallelized(spec, replicated, pending, sharded)


def check(module: nn.Module, topo: Topology, cp_comm_type: str = "p2p", moe: MoEConfig | None = None):
    """Refuse, before any collective, a model a dimension cannot run whatever its weights (an
    encoder under context parallelism, an unknown ``cp_comm_type``, a MoE model whose experts the
    expert-parallel degree cannot split or whose layout is unknown, or whose auxiliary loss would
    span pipeline stages).

    Returns:
        The expert-parallel work to apply (``expert.apply_experts``).

    Raises:
        ValueError, NotImplementedError: naming the model type or the value at fault.
    """
    context.check_comm_type(cp_comm_type)
    cfg = topo.config
    experts = check_experts(module, cfg.expert_parallel_degree, _field(module, "experts"), moe,
                            tuple(t for t, a in BUILT_IN.items() if a.experts),
                            cfg.tensor_parallel_degree if cfg.expert_tensor_parallel else 1, cfg.sequence_parallel)
    if topo.config.context_parallel_degree > 1:
        context.check_model(module, _field(module, "context"))
    if topo.config.pipeline_parallel_degree > 1:
        pipeline.check_model(module)
    return experts


def _ep_tp_mesh(topo: Topology, experts):
    """The 2-D ``("ep", "tp")`` mesh expert tensor parallelism shards the experts over, or None."""
    return topo.expert_mesh["ep", "tp"] if experts is not None and experts.tp > 1 else None


def _field(module: nn.Module, name: str):
    """One field of ``module``'s architecture record, or None for a model with no record."""
    return getattr(architecture_for(module), name, None)


def _pipeline_split(module: nn.Module):
    """The record's pipeline split; a model with no record: transformers' own pipeline plan."""
    record = architecture_for(module)
    return record.pipeline if record is not None else hf_pipeline_split(module)


def plan(module: nn.Module, topo: Topology, options: creation.CreationOptions | None) -> ArchSpec | None:
    """The tensor-parallel plan: the architecture's own, else the automatic one (a collective
    when derived), without the vocabulary rules where ``model_creation`` keeps embeddings whole."""
    spec = auto.plan_for(module, architecture_for(module), topo.tp_mesh, walker.parallelize,
                         topo.config.sequence_parallel)
    if options is not None and not options.distribute_embedding:
        spec = creation.without_vocab(spec)
    return spec
