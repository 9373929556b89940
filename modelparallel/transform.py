"""``smp.transform``: SageMaker v2's in-place tensor-parallel transform (the API layer; the sync
from rank 0 lives in ``materialize/rank0_sync.py``).

``transform`` shards a supported HF model over the TP mesh in place and returns it (no
wrapper), so FSDP or a user's training loop can be applied afterwards. With
``load_state_dict_from_rank0=True`` only rank 0 needs real weights (the others build the same
model on the meta device): every rank first moves its model to meta, so all ranks shard
identically without communication, then each rank gives its shards storage and rank 0 sends
every rank exactly its block of each tensor (point to point, in one fixed order every rank
follows; replicated tensors by broadcast). No rank but 0 ever holds more than its shards.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from . import runtime
from . import context
from .materialize import meta
from .materialize.rank0_sync import (  # noqa: F401 - SYNCED_FROM_RANK0, meta_states, move: re-exported
    SYNCED_FROM_RANK0, check_rank0_source, meta_states, move, sync_from_rank0)
from .models import architecture_for
from .moe.moe_config import MoEConfig
from .parallelize import check, parallelize
from .tensor_parallel.transformer import mark_transformer_layers
from .tp import auto, marks, walker
from .distributed.checkpoint import group_blocks
from .training import fsdp1_tp_state

logger = logging.getLogger("modelparallel")

CP_COMM_TYPES = context.COMM_TYPES


def _runtime(config: dict | None) -> runtime.Runtime:
    if not runtime.is_initialized():
        return runtime.init(config)
    rt = runtime.current()
    if config:
        cfg = rt.config
        wrong = {k: v for k, v in config.items() if getattr(cfg, k, v) != v}
        if wrong:
            raise ValueError(f"transform(config=...) disagrees with the running config: {wrong}; "
                             "call smp.init with that config instead")
    return rt


def _registered_or_marked(model: nn.Module) -> bool:
    """Whether any module asks for tensor parallelism itself (a registration, or built inside
    ``smp.tensor_parallelism()``): those go through the walker even at degree 1."""
    return any(marks.registration_of(m) is not None or "_mp_tp" in m.__dict__ for m in model.modules())


def transform(model: nn.Module, device=None, dtype: torch.dtype | None = None,
              config: dict | MoEConfig | None = None, load_state_dict_from_rank0: bool = False,
              cp_comm_type: str = "p2p") -> nn.Module:
    """Shard a supported HF model over the tensor-parallel mesh (and a mixture-of-experts model's
    experts over the expert-parallel ranks) in place and return it.

    At tensor-parallel degree 1 a plain HF model is not sharded: parameters stay plain tensors (a
    DTensor on a mesh of one rank would only get in the way of FSDP's flattening), and only the
    device, dtype and rank-0 sync apply (modules registered or built inside
    ``smp.tensor_parallelism()`` still go through the walker).

    Args:
        model: the model; with ``load_state_dict_from_rank0`` a real model on rank 0 and the same
            model on the meta device (expected, to save memory) or real elsewhere.
        device: where real tensors go (default: the runtime's device).
        dtype: cast floating parameters and buffers to it.
        config: SageMaker's ``MoEConfig`` (``modelparallel.moe.moe_config``) for a
            mixture-of-experts model: its routing options and dispatcher; or the modelparallel
            config dict, used to ``init`` if not yet initialized (else it must agree with the
            running one).
        load_state_dict_from_rank0: afterwards every rank holds exactly its shard of rank 0's
            weights (so FSDP's ``sync_module_states`` and a ``DelayedParamIniter`` of the result
            have nothing left to do). A collective: call on every rank.
        cp_comm_type: context parallelism's communication at ``context_parallel_degree`` > 1:
            "p2p" (ring attention: keys and values passed rank to rank, overlapped with compute)
            or "all_gather" (gathered once per layer). Checked, and without effect, at degree 1.

    Without ``load_state_dict_from_rank0``, a model built on meta stays on meta (shards
    described, not allocated) until ``smp.load_hf_checkpoint`` or ``DelayedParamIniter``
    initializes it.

    Returns:
        ``model`` itself, sharded in place.

    Raises:
        MetaTensorError: with ``load_state_dict_from_rank0`` when rank 0's model is on meta.
        ValueError: when the plan does not fit the model (before any tensor is touched), or for
            an unknown ``cp_comm_type``.
        NotImplementedError: context parallelism of an architecture it cannot run (an encoder),
            or together with expert parallelism; pipeline_parallel_degree > 1 (the v1 API's).
    """
    context.check_comm_type(cp_comm_type)
    moe = config if isinstance(config, MoEConfig) else None
    rt = _runtime(None if moe is not None else config)
    if rt.config.pipeline_parallel_degree > 1:  # the stages run only under DistributedModel's @smp.step
        raise NotImplementedError(f"transform at pipeline_parallel_degree {rt.config.pipeline_parallel_degree}: "
                                  "pipeline parallelism runs through smp.DistributedModel and @smp.step")
    check(model, rt, cp_comm_type, moe)  # before the rank-0 sync's first collective
    device = torch.device(device) if device is not None else rt.device
    full = {}
    if load_state_dict_from_rank0:
        check_rank0_source(meta_states(model))
        full = meta.to_meta_(model)
        if dist.get_rank() != 0:
            full = {}
    move(model, device, dtype)
    mark_transformer_layers(model)  # isinstance(block, TransformerLayer) for FSDP's wrap policy
    # v2 scripts save through DCP over the FSDP (or replication) group, naming its coordinator by
    # global rank, and each TP rank's block over that group
    group_blocks.install()
    fsdp1_tp_state.install()  # users wrap the result in FSDP1 and resume through DCP
    sharded = rt.tp_mesh.size() > 1 or _registered_or_marked(model)
    experts = moe is not None or rt.config.expert_parallel_degree > 1
    if sharded or experts or rt.config.context_parallel_degree > 1:
        spec = auto.plan_for(model, architecture_for(model), rt.tp_mesh, walker.parallelize)  # built-in or automatic
        with meta.torch_parameter_registration():  # v2 scripts may call transform in init_empty_weights()
            parallelize(model, rt, spec, cp_comm_type, moe=moe, tensor_parallel=sharded)
    if load_state_dict_from_rank0:
        meta.materialize(model, device)
        sync_from_rank0(model, full, rt.expert_mesh)  # names every mesh dim a DTensor here can have
        full.clear()
        model.__dict__[SYNCED_FROM_RANK0] = True
    return model
