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
from torch import nn

from . import context, runtime
from .activations.wrappers import lifted
from .config import unbuilt_combinations
from .expert.config import MoEConfig
from .materialize.rank0_sync import (  # noqa: F401 - SYNCED_FROM_RANK0, meta_states, move: re-exported
    SYNCED_FROM_RANK0, meta_states, move)
from .parallelize import Request, check, parallelize
from .pipeline import whole
from .tp import marks
from .training.blocks import mark_transformer_layers

logger = logging.getLogger("modelparallel")

CP_COMM_TYPES = context.COMM_TYPES


def _runtime(config: dict | None) -> runtime.Runtime:
    """The running job, started here (its config checked as a v2 job's) if there is none."""
    if not runtime.is_initialized():
        return runtime.init(config, api="v2")
    rt = runtime.current()
    if config:
        cfg = rt.config
        wrong = {k: v for k, v in config.items() if getattr(cfg, k, v) != v}
        if wrong:
            raise ValueError(f"transform(config=...) disagrees with the running config: {wrong}; "
                             "call smp.init with that config instead")
    refused = unbuilt_combinations(rt.config, "v2")  # smp.init could not know transform would run
    if refused:
        raise NotImplementedError("; ".join(refused))
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
        config: SageMaker's ``MoEConfig`` (``modelparallel.expert.config``) for a
            mixture-of-experts model: its routing options and dispatcher; or the modelparallel
            config dict, used to ``init`` if not yet initialized (else it must agree with the
            running one).
        load_state_dict_from_rank0: afterwards every rank holds exactly its shard of rank 0's
            weights (so FSDP's ``sync_module_states`` and a ``DelayedParamIniter`` of the result
            have nothing left to do). A collective: call on every rank.
        cp_comm_type: context parallelism's communication at ``context_parallel_degree`` > 1:
            "p2p" (ring attention: keys and values passed rank to rank, overlapped with compute)
            or "all_gather" (gathered once per layer). Checked, and without effect, at degree 1.

    PyTorch's activation wrappers (``apply_activation_checkpointing``) applied before ``transform``
    are set aside while it shards the model and put back around the sharded blocks
    (``activations/wrappers.py``).

    Without ``load_state_dict_from_rank0``, a model built on meta stays on meta (shards
    described, not allocated) until ``smp.load_hf_checkpoint`` or ``DelayedParamIniter``
    initializes it.

    Returns:
        ``model`` itself, sharded in place.

    Raises:
        MetaTensorError: with ``load_state_dict_from_rank0`` when rank 0's model is on meta.
        ValueError: when the plan does not fit the model (before any tensor is touched), for
            an unknown ``cp_comm_type``, or for a model that is itself an activation wrapper.
        NotImplementedError: context parallelism of an architecture it cannot run (an encoder),
            weights tied across pipeline stages, or virtual pipeline stages.

    At ``pipeline_parallel_degree`` > 1 the model is cut down to this rank's stage and each call
    runs one batch through every stage (``pipeline/whole.py``): the model computes the loss
    (``labels=``), every rank gets it and calls ``backward`` on it.
    """
    context.check_comm_type(cp_comm_type)
    moe = config if isinstance(config, MoEConfig) else None
    rt = _runtime(None if moe is not None else config)
    pipelined = rt.config.pipeline_parallel_degree > 1
    with lifted(model, caller="smp.transform"):  # a script's checkpoint wrappers, put back after
        check(model, rt.topology, cp_comm_type, moe)  # before the rank-0 sync's first collective
        if pipelined:
            whole.check(model, rt.config.pipeline_virtual_stages)
        sharded = rt.tp_mesh.size() > 1 or _registered_or_marked(model)
        ask = Request("v2", torch.device(device) if device is not None else rt.device, dtype, cp_comm_type, moe,
                      from_rank0=load_state_dict_from_rank0, tensor_parallel=sharded)
        parallelize(model, rt.topology, ask)
        mark_transformer_layers(model)  # isinstance(block, TransformerLayer) for FSDP's wrap policy
    if load_state_dict_from_rank0:
        model.__dict__[SYNCED_FROM_RANK0] = True
    if pipelined:  # one call = one batch through every stage (pipeline/whole.py)
        whole.install(model, whole.link_of(rt.group(runtime.PP_GROUP), rt.device))
    return model
