"""Where a model's weights come from, and giving its shards their values: the steps the one
composition (``parallelize``) runs before and after sharding, for models that are not simply
real and identical on every rank.

Before sharding the ranks agree on where the weights come from (the v1 API finds out, through
one small all-gather of every rank's meta state, so no rank waits in a collective the others
skip; the v2 API is told, by ``load_state_dict_from_rank0``):

* ``REAL``: every rank holds the weights: move to the device and shard;
* ``RANK0``: rank 0 holds them, the others are on meta: everything goes to meta (rank 0 keeping
  its tensors), all ranks shard alike, then rank 0 sends each rank exactly its blocks;
* ``META``: every rank is on meta: shard, then initialize (built in a delayed-init context, v1)
  or stay on meta until ``smp.load_hf_checkpoint`` (forward refuses);
* any other mix: refused on every rank, naming the ranks.

The v1 API also ties the weights the HF config ties before sharding (scripts that skip HF's
``init_weights`` also skip its tying), and after the shards have values makes every parameter
held whole on each TP rank equal to TP rank 0's (``tp_sync``).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from . import creation_options as creation
from . import hf_init, meta
from .init_engine import InitEngine
from .rank0_sync import check_rank0_source, meta_states, sync_from_rank0
from .tp_sync import broadcast_replicated

logger = logging.getLogger("modelparallel")

REAL, RANK0, META = "real", "rank0", "meta"


def prepare_v1(module: nn.Module, options: creation.CreationOptions | None) -> None:
    """Tie what the HF config ties and apply ``model_creation``'s attention options (v1)."""
    if hf_init.tie_as_config(module) and dist.get_rank() == 0:
        logger.info("tied the weights %s's config ties (they were separate copies: was "
                    "PreTrainedModel.init_weights replaced?)", type(module).__name__)
    creation.apply_attention(module, options)


def _agreed(states: list[tuple[bool, bool]]) -> str:
    metas = [r for r, (has_meta, _) in enumerate(states) if has_meta]
    real = [r for r, (has_meta, has_real) in enumerate(states) if not has_meta and has_real]
    if not metas:
        return REAL
    if 0 in real and len(real) == 1:
        return RANK0
    if len(metas) == len(states):
        return META
    raise meta.MetaTensorError(f"ranks {metas} hold a model with meta-device tensors and ranks {real} a real one: "
                               "either every rank builds on meta, or only rank 0 holds real weights")


def source(module: nn.Module, topo, find: bool, from_rank0: bool) -> str:
    """Where the weights come from: ``REAL``, ``RANK0`` or ``META``; a collective when ``find``
    (v1) or ``from_rank0`` (v2 told so, checked against every rank's model).

    Raises:
        MetaTensorError: a mix of meta and real models no source explains, or (``from_rank0``)
            rank 0's model on meta.
        NotImplementedError: a model real on rank 0 only under pipeline parallelism.
    """
    if from_rank0:
        check_rank0_source(meta_states(module))
        return RANK0
    if not find or dist.get_world_size() == 1:
        return META if meta.has_meta(module) else REAL
    found = _agreed(meta_states(module))
    if found == RANK0 and topo.config.pipeline_parallel_degree > 1:
        raise NotImplementedError(
            "a model real on rank 0 only (meta elsewhere) at pipeline_parallel_degree > 1: build it on the meta "
            "device on every rank and load it with smp.load_hf_checkpoint (each stage reads its own tensors), or "
            "build it in smp.delay_param_initialization()")
    return found


def to_meta_keeping_rank0(module: nn.Module) -> dict[str, torch.Tensor]:
    """Move ``module`` to meta on every rank; rank 0 keeps its full tensors (returned) to send
    each rank its blocks once the model is sharded. Other ranks get ``{}``."""
    full = meta.to_meta_(module)
    return full if dist.get_rank() == 0 else {}


def give_values(module: nn.Module, topo, where: str, full: dict[str, torch.Tensor], device: torch.device,
                delayed: bool, equalize: bool) -> bool:
    """Give the sharded model's tensors storage and values: rank 0's (``RANK0``, consuming
    ``full``), or by delayed init (``META`` built in a delayed-init context); then, when
    ``equalize``, every parameter held whole on each TP rank is made TP rank 0's.

    Returns:
        Whether the model is left on meta, waiting for a load.
    """
    pending = where == META
    if where == RANK0:
        meta.materialize(module, device)
        sync_from_rank0(module, full, topo.expert_mesh)  # names every mesh dim a DTensor here can have
        full.clear()
    elif pending and delayed:
        initer = InitEngine(module, device=device)
        with initer.validate_params_and_buffers_inited():
            initer.init_all()
        pending = False
    if equalize and where != RANK0 and not pending:  # the sync from rank 0 made them equal already
        broadcast_replicated(module, topo.tp_mesh)
    return pending


def check_ready(module: nn.Module, composed) -> None:
    """Refuse to run a model whose shards were never given values (``composed``: the result of
    ``parallelize``, updated once a load gave them values)."""
    if composed.pending_meta:
        if meta.has_meta(module):
            raise meta.MetaTensorError(
                "this DistributedModel was built on the meta device and has no weights yet: load them with "
                "smp.load_hf_checkpoint(model, directory), or build it inside smp.delay_param_initialization() "
                f"to initialize it; still on meta: {', '.join(meta.meta_names(module)[:8])}...")
        composed.pending_meta = False
