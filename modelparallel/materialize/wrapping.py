"""The steps ``DistributedModel`` runs around the TP walker, for models that are not simply real
and identical on every rank: built on the meta device, built in ``model_creation`` /
``delay_param_initialization``, real only on rank 0, or to be sharded over data parallelism too.

Before sharding every rank learns every rank's meta state (one small all-gather), so all ranks
take the same path and no rank waits in a collective the others skip. The outcomes:

* all real: as before (move to the device, shard);
* rank 0 real, others meta: everything to meta, shard, then rank 0 sends each rank its blocks;
* all meta, built in a delayed-init context: shard, then ``InitEngine.init_all``;
* all meta otherwise: shard and stay on meta until ``smp.load_hf_checkpoint`` (forward refuses);
* any other mix: refused on every rank, naming the ranks.

Two fixes apply to every path: the weights the HF config ties are tied before sharding (scripts
that skip HF's ``init_weights`` also skip its tying), and after the shards have values every
parameter held whole on each TP rank is made equal to TP rank 0's (``tp_sync``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..models import architecture_for
from ..models._sagemaker import offer_tree
from ..tp import auto, walker
from ..tp.plan import ArchSpec
from ..training import fsdp
from . import creation_options as creation
from . import hf_init, meta
from .init_engine import InitEngine
from .rank0_sync import meta_states, move, sync_from_rank0
from .tp_sync import broadcast_replicated

logger = logging.getLogger("modelparallel")


@dataclass
class WrapState:
    spec: ArchSpec | None
    options: creation.CreationOptions | None
    full_on_rank0: dict = field(default_factory=dict)
    from_rank0: bool = False
    pending_meta: bool = False
    fsdp: bool = False
    compute_dtype: torch.dtype | None = None


def _mode(states: list[tuple[bool, bool]]) -> str:
    metas = [r for r, (has_meta, _) in enumerate(states) if has_meta]
    real = [r for r, (has_meta, has_real) in enumerate(states) if not has_meta and has_real]
    if not metas:
        return "real"
    if 0 in real and len(real) == 1:
        return "rank0"
    if len(metas) == len(states):
        return "meta"
    raise meta.MetaTensorError(f"ranks {metas} hold a model with meta-device tensors and ranks {real} a real one: "
                               "either every rank builds on meta, or only rank 0 holds real weights")


def before_shard(module: nn.Module, rt, dtype: torch.dtype | None) -> WrapState:
    """Agree on the path, move/cast what has data, pick the plan; a collective."""
    options = creation.options_of(module)
    if hf_init.tie_as_config(module) and dist.get_rank() == 0:
        logger.info("tied the weights %s's config ties (they were separate copies: was "
                    "PreTrainedModel.init_weights replaced?)", type(module).__name__)
    spec = auto.plan_for(module, architecture_for(module), rt.tp_mesh, walker.parallelize)  # built-in or automatic
    if options is not None and not options.distribute_embedding:
        spec = creation.without_vocab(spec)
    fsdp.check_degree(rt.config.shard_degree, rt.config.replica_degree)
    creation.apply_attention(module, options)
    state = WrapState(spec, options)
    mode = _mode(meta_states(module)) if dist.get_world_size() > 1 else ("meta" if meta.has_meta(module) else "real")
    if mode == "rank0" and rt.config.pipeline_parallel_degree > 1:
        raise NotImplementedError(
            "a model real on rank 0 only (meta elsewhere) at pipeline_parallel_degree > 1: build it on the meta "
            "device on every rank and load it with smp.load_hf_checkpoint (each stage reads its own tensors), or "
            "build it in smp.delay_param_initialization()")
    if mode == "rank0":
        full = meta.to_meta_(module)
        state.full_on_rank0, state.from_rank0 = (full if dist.get_rank() == 0 else {}), True
    # under FSDP the sharded parameters stay fp32 (they are the master weights) and FSDP casts
    # them to ``dtype`` for compute (``fsdp.mixed_precision``)
    state.compute_dtype = dtype
    move(module, rt.device, None if rt.config.shard_degree > 1 else dtype)
    state.pending_meta = mode == "meta"
    return state


def after_shard(module: nn.Module, rt, state: WrapState) -> None:
    """Give the shards storage and values (from rank 0, or by delayed init), then FSDP."""
    if state.from_rank0:
        meta.materialize(module, rt.device)
        sync_from_rank0(module, state.full_on_rank0, rt.expert_mesh)
        state.full_on_rank0.clear()
    elif state.pending_meta and state.options is not None and state.options.delayed:
        initer = InitEngine(module, device=rt.device)
        with initer.validate_params_and_buffers_inited():
            initer.init_all()
        state.pending_meta = False
    if not state.from_rank0 and not state.pending_meta:  # the sync from rank 0 made them equal already
        broadcast_replicated(module, rt.tp_mesh)
    state.fsdp = fsdp.shard_data_parallel(module, rt.dp_mesh, state.spec, rt.config.shard_degree,
                                          fsdp.mixed_precision(state.compute_dtype),
                                          keep_gathered=rt.config.keep_params_gathered, expert_replicas=rt.edp_mesh)
    layout = getattr(architecture_for(module), "sagemaker", None)
    if layout is not None:  # SageMaker's names (seq_layers, .attention, .output) as aliases
        offer_tree(module, layout)


def check_ready(module: nn.Module, state: WrapState) -> None:
    """Refuse to run a model whose shards were never given values."""
    if state.pending_meta:
        if meta.has_meta(module):
            raise meta.MetaTensorError(
                "this DistributedModel was built on the meta device and has no weights yet: load them with "
                "smp.load_hf_checkpoint(model, directory), or build it inside smp.delay_param_initialization() "
                f"to initialize it; still on meta: {', '.join(meta.meta_names(module)[:8])}...")
        state.pending_meta = False
