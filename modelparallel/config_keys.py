"""Every configuration key SageMaker model parallelism knows (v1 ``smp.init`` and v2
``torch.sagemaker.init``), with its default and what it does here. Data only.

Status of a key:

- ``implemented``: the library honours the value.
- ``no effect``: accepted; it tunes SageMaker's own tracer, pipeline scheduler or communication
  buffers, which do not exist here, so results do not depend on it. Setting it is logged once on
  rank 0.
- ``default only``: the default value is honoured; another value would change results and is not
  built, so ``init`` raises ``NotImplementedError`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IMPLEMENTED, NO_EFFECT, DEFAULT_ONLY = "implemented", "no effect", "default only"


@dataclass(frozen=True)
class Key:
    """One configuration key."""

    name: str
    type: type
    default: Any
    status: str
    doc: str
    api: str = "v1"
    """Which SageMaker API has the key: "v1", "v2" or "v1+v2"; "ours" for an extension key
    SageMaker does not have."""
    minimum: int | None = None
    """The smallest value accepted (numbers only); None: no bound."""


KEYS: tuple[Key, ...] = (
    # --- layout ------------------------------------------------------------------------------
    Key("tensor_parallel_degree", int, 1, IMPLEMENTED,
        "Ranks sharing one copy of each layer, each holding 1/degree of its weights.", "v1+v2", minimum=1),
    Key("pipeline_parallel_degree", int, 1, IMPLEMENTED,
        "Pipeline stages (alias ``partitions``): each stage holds a contiguous range of layers and "
        "``@smp.step``'s microbatches flow through them.", minimum=1),
    Key("placement_strategy", str, "cluster", IMPLEMENTED,
        "Rank order: \"cluster\" (= \"DPT\"), \"spread\" (= \"TPD\") or any order of D, P, T."),
    Key("random_seed", int, 12345, IMPLEMENTED, "Seed set on every rank by ``init``.", "v1+v2"),
    # --- batches -----------------------------------------------------------------------------
    Key("microbatches", int, 1, IMPLEMENTED,
        "``@smp.step`` splits each batch into this many microbatches and accumulates gradients.", minimum=1),
    Key("prescaled_batch", bool, False, IMPLEMENTED,
        "False: every rank of a TP group brings its own batch and the group computes on their "
        "union. True: the TP ranks of a group bring the same batch."),
    # --- data parallelism --------------------------------------------------------------------
    Key("ddp", bool, True, IMPLEMENTED,
        "Average gradients over the reduced-data-parallel group (SageMaker's default is False; "
        "here data parallelism is on unless switched off)."),
    Key("ddp_port", int, 0, NO_EFFECT, "The launcher (torchrun) chooses the port."),
    Key("ddp_dist_backend", str, "auto", NO_EFFECT, "gloo on CPU, nccl on GPU, chosen by ``init``."),
    Key("horovod", bool, False, DEFAULT_ONLY, "Horovod data parallelism is not built."),
    Key("sharded_data_parallel_degree", int, 1, IMPLEMENTED,
        "Shard parameters, gradients and optimizer state over the reduced-data-parallel ranks "
        "(FSDP2); 0 and 1 mean off.", minimum=0),
    Key("sdp_reduce_bucket_size", int, 500_000_000, NO_EFFECT, "FSDP2 buckets per module."),
    Key("sdp_param_persistence_threshold", int, 1_000_000, NO_EFFECT,
        "Every parameter of a sharded module is sharded."),
    Key("sdp_max_live_parameters", int, 1_000_000_000, NO_EFFECT, "FSDP2 gathers one module at a time."),
    Key("sdp_hierarchical_allgather", bool, True, NO_EFFECT, "One all-gather over the group."),
    Key("sdp_gradient_clipping", float, 1.0, DEFAULT_ONLY,
        "SageMaker clips gradients implicitly under sharded data parallelism; here nothing is "
        "clipped implicitly (call the optimizer's ``clip_master_grads``), and another threshold "
        "is refused."),
    Key("shard_optimizer_state", bool, False, IMPLEMENTED,
        "Optimizer state and gradients sharded over the rdp ranks by FSDP2, parameters kept "
        "gathered from forward to backward (ZeRO-2; the same numerics as plain data parallelism)."),
    Key("hybrid_shard_degree", int, 0, IMPLEMENTED,
        "v2: FSDP sharding degree; 0 shards over all data-parallel ranks, 1 replicates.", "v2", minimum=0),
    Key("allow_empty_shards", bool, False, NO_EFFECT,
        "v2: uneven and empty shards are always allowed here.", "v2"),
    Key("fsdp_cache_flush_warnings", bool, True, NO_EFFECT, "v2: CUDA allocator warnings.", "v2"),
    Key("context_parallel_degree", int, 1, IMPLEMENTED,
        "v2: ranks splitting every sequence (ring or all-gather attention); each rank gets "
        "chunks r and 2C-1-r of 2C (``smp.get_batch_for_cp_rank``).", "v2", minimum=1),
    Key("expert_parallel_degree", int, 1, IMPLEMENTED,
        "v2: ranks sharing one copy of each MoE layer's experts, each holding 1/degree of them; "
        "carved out of the data-parallel ranks, so it must divide world / (tp x pp x cp).", "v2", minimum=1),
    Key("expert_tensor_parallel", bool, False, IMPLEMENTED,
        "Ours: at tensor_parallel_degree > 1, every MoE layer's experts are split over the "
        "tensor-parallel ranks too (each expert's gate/up rows and down columns, 1/degree per rank: "
        "1/(ep x tp) of the expert weights per rank); false: each TP group holds its experts whole.", "ours"),
    Key("sequence_parallel", bool, False, IMPLEMENTED,
        "Ours: inside tensor parallelism, norms, dropout and residual adds run on sequence shards "
        "(Megatron's sequence parallelism); the sequence must divide by the degree.", "ours"),
    # --- precision ---------------------------------------------------------------------------
    Key("fp16", bool, False, IMPLEMENTED, "Train in float16 with a loss-scaling optimizer."),
    Key("bf16", bool, False, IMPLEMENTED, "Train in bfloat16."),
    Key("fp16_params", bool, False, IMPLEMENTED, "Distributed modules hold float16 parameters."),
    # --- memory ------------------------------------------------------------------------------
    Key("delayed_parameter_initialization", bool, False, IMPLEMENTED,
        "Delayed initialization is driven by ``smp.delay_param_initialization()``; the key "
        "itself is accepted as SageMaker requires it next to that context."),
    Key("offload_activations", bool, False, IMPLEMENTED,
        "Checkpointed activations are kept in host memory until backward."),
    Key("activation_loading_horizon", int, 4, IMPLEMENTED,
        "How many checkpointed modules ahead activations are brought back.", "v1+v2", minimum=1),
    Key("sm_activation_offloading", bool, False, IMPLEMENTED, "v2 name of offload_activations.", "v2"),
    # --- checkpoints ---------------------------------------------------------------------------
    Key("checkpoint_staging", str, "auto", IMPLEMENTED,
        "Ours: how ``resume_from_checkpoint`` keeps a failed load from changing anything: \"memory\" "
        "(a staged copy of what each rank loads), \"journal\" (buckets written through an undo journal "
        "on local disk, put back on failure), \"auto\" (memory if it fits in MemAvailable).", "ours"),
    Key("checkpoint_staging_bucket", int, 64 << 20, IMPLEMENTED,
        "Ours: the journal's bucket, in bytes: what a journal-mode load holds in memory at most "
        "(plus the piece being read).", "ours", minimum=1),
    Key("checkpoint_drop_behind", bool, True, IMPLEMENTED,
        "Ours: a partial save drops each range of its files from the page cache once the disk has "
        "it (faster, steadier saves; the job's own cached files stay); false keeps the checkpoint "
        "cached, for a resume soon after on the same machine.", "ours"),
    # --- SageMaker's tracer and pipeline scheduler -------------------------------------------
    Key("pipeline", str, "interleaved", IMPLEMENTED,
        "Pipeline schedule: \"interleaved\" = one forward, one backward (1F1B; with fewer microbatches "
        "than stages, GPipe), \"simple\" = all forwards, then all backwards (GPipe)."),
    Key("pipeline_virtual_stages", int, 1, IMPLEMENTED,
        "Ours: pipeline stages per pipeline rank (virtual stages): the layers are cut into "
        "pipeline_parallel_degree x this many stages and rank r runs stages r, r + degree, ... "
        "(the interleaved schedule's smaller bubble); 1: one stage per rank.", "ours", minimum=1),
    Key("active_microbatches", int, 0, IMPLEMENTED,
        "Pipeline in-flight limit: the step's microbatches run through the schedule in rounds of "
        "this many (0: all at once).", minimum=0),
    Key("deterministic_server", bool, False, NO_EFFECT, "Pipeline execution server; none here."),
    Key("optimize", str, "memory", NO_EFFECT,
        "SageMaker's layer distribution choice; results are the same either way."),
    Key("auto_partition", bool, True, IMPLEMENTED,
        "True: layers balanced over the stages by parameter count (partition marks ignored); false: "
        "``smp.partition`` / ``smp.set_partition`` marks place them."),
    Key("default_partition", int, 0, IMPLEMENTED,
        "With ``auto_partition`` false, the partition of layers without a mark.", minimum=0),
    Key("memory_weight", float, 0.8, NO_EFFECT,
        "Pipeline partitioning objective; a layer's memory and compute are both its parameter count here."),
    Key("contiguous", bool, True, NO_EFFECT, "Pipeline partitioning (TensorFlow)."),
    Key("skip_tracing", bool, False, NO_EFFECT, "No tracing step exists here."),
    Key("static_mode", bool, False, NO_EFFECT, "Tracer/scheduler caching; none here."),
    Key("fast_mode", bool, False, NO_EFFECT, "Pipeline communication shortcut; none here."),
)

ALIASES = {"partitions": "pipeline_parallel_degree"}
"""Other spellings SageMaker accepts for a key."""

PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}
"""``placement_strategy``'s names for orders of the letters D, P, T (slowest-varying first)."""

BY_NAME = {k.name: k for k in KEYS}
