"""Full model state dicts of, and loading optimizer state into, PyTorch FSDP1 (``FullyShardedDataParallel``) wrapped around
tensor-parallel DTensor parameters.

FSDP1 saves the optimizer state of a TP-sharded parameter as a DTensor on the 2-D
("dp", "tp") mesh: its TP-local state chunked over "dp" (placements ``(Shard(0), tp)``). Loading
it back (``FSDP.optim_state_dict_to_load``, which ``torch.distributed.checkpoint.state_dict.
set_state_dict`` calls) gathers every DTensor to the *global* tensor and then cuts this rank's
flat-parameter range out of it, as if the gathered tensor were the TP-local one. For a parameter
sharded over "tp" that range lies in the wrong block: every TP rank gets the first TP rank's
moments, and the first steps after a resume drift from the uninterrupted run.

``install`` wraps the gather FSDP1 uses on that path so that a DTensor on a mesh of two or more
dimensions is gathered over every dimension but the last (the tensor-parallel one, where FSDP1
puts it) and comes back as this rank's TP-local tensor, which is what the flat-parameter ranges
index. State saved without tensor parallelism (a 1-D mesh, or plain tensors) is passed through.

Without sharding (``NO_SHARD``: TP at data-parallel size 1) FSDP1's parameters stay DTensors, but
the loaded state is the TP-local tensor FSDP1 keeps whole, a plain tensor, and the next
``optimizer.step()`` fails mixing it with the DTensor gradient. ``install`` also wraps the
per-parameter step that hands the state to the optimizer so that, there, each state tensor of
a DTensor parameter becomes a DTensor with the parameter's layout (the same memory).

A sharded model state dict (``StateDictType.SHARDED_STATE_DICT``) holds each TP parameter as
a DTensor on the world mesh that FSDP1 shards on the dimension before "tp" ("cp"), as a plain
``Shard``: DTensor reads it as split before TP, so a rank holds a chunk of the whole tensor, not
of its TP block, and under context parallelism a TP rank's FSDP group (its cp ranks) holds no
single block to save over that group. ``install`` wraps FSDP1's chunking so the shard is a
``StridedShard`` (split after TP, FSDP2's placement for the same layout): each rank holds a chunk
of its TP block, and the group its whole block.

A full model state dict (``StateDictType.FULL_STATE_DICT``, how v2 scripts export a model for
``from_pretrained``) keeps each DTensor parameter as this rank's DTensor view after FSDP1's
gather: saved, it would hold one TP rank's shard. ``install`` also wraps FSDP1's full-state-dict
hook so that every rank first gathers each DTensor entry of the unit to the whole tensor (a
collective every rank makes in the same order), before FSDP1 drops the entries of ranks other
than 0 under ``rank0_only``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...compat import StridedShard, tp_fsdp_extension
from ...compat import fsdp_optim_utils as _optim_utils
from ...compat import fsdp_state_dict_utils as _state_dict_utils
from ..wrapping import wrap_once

_MARK = "_mp_tp_local"


def tp_local(value):
    """``value`` gathered over all mesh dimensions but the last, as a local tensor, for a DTensor
    whose last mesh dimension is the tensor-parallel one ("tp": the world mesh FSDP1 lays TP state
    on, or the "tp" mesh alone, which is how the state of a DTensor parameter comes when FSDP1 does
    not shard); anything else (a hybrid-sharding ("replicate", "shard") mesh) is returned unchanged."""
    if not isinstance(value, DTensor):
        return value
    names = value.device_mesh.mesh_dim_names or ()
    if tuple(names[-1:]) != ("tp",):
        return value
    placements = [Replicate()] * (value.device_mesh.ndim - 1) + [value.placements[-1]]
    return value.redistribute(value.device_mesh, placements).to_local()


def _tp_local_state(state):
    if isinstance(state, dict):
        return {k: _tp_local_state(v) for k, v in state.items()}
    return tp_local(state)


def _as_param_layout(state: dict, spec) -> dict:
    """Each tensor of ``state`` with the layout ``spec`` of the DTensor parameter it belongs to."""
    return {k: DTensor.from_local(v, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                  stride=spec.stride)
            if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0 else v for k, v in state.items()}


def _install_no_shard_layout() -> None:
    def wrap(shard):
        def with_param_layout(fsdp_param_info, fqn, optim_state):
            state = shard(fsdp_param_info, fqn, optim_state)
            if fsdp_param_info.state.sharding_strategy != ShardingStrategy.NO_SHARD or not state:
                return state
            spec = fsdp_param_info.handle.flat_param._param_extensions[fsdp_param_info.param_indices[fqn]]
            return state if spec is None else _as_param_layout(state, spec)
        return with_param_layout

    wrap_once(_optim_utils, "_shard_orig_param_state", wrap, _MARK)


_ASKED = "_mp_asked_state_dict_type"


def _install_full_state_dict() -> None:
    def remember(substitute):
        @contextlib.contextmanager
        def remembering_asked(fsdp_state):
            # FSDP1 makes every state dict of a NO_SHARD unit a full one: the type the user asked
            # for (sharded: the TP blocks stay DTensors) is kept for the hook below
            asked = fsdp_state._state_dict_type
            with substitute(fsdp_state):
                setattr(fsdp_state, _ASKED, asked)
                try:
                    yield
                finally:
                    delattr(fsdp_state, _ASKED)
        return remembering_asked

    def gather(full):
        def gathered_whole(module, fsdp_state, state_dict, prefix):
            if getattr(fsdp_state, _ASKED, StateDictType.FULL_STATE_DICT) == StateDictType.FULL_STATE_DICT:
                with torch.no_grad():
                    for key, value in list(state_dict.items()):
                        if key.startswith(prefix) and isinstance(value, DTensor):
                            state_dict[key] = value.full_tensor()
            return full(module, fsdp_state, state_dict, prefix)
        return gathered_whole

    wrap_once(_state_dict_utils, "_replace_with_full_state_dict_type", remember, _MARK)
    wrap_once(_state_dict_utils, "_full_post_state_dict_hook", gather, _MARK)


def after_tp(value: DTensor) -> DTensor:
    """``value`` (FSDP1's chunk of a TP parameter on the world mesh) with the FSDP shard before
    "tp" split after TP's when both cut the same tensor dimension over more than one rank."""
    placements, mesh = list(value.placements), value.device_mesh
    fsdp, tp = placements[-2], placements[-1]
    if not (isinstance(fsdp, Shard) and isinstance(tp, Shard) and fsdp.dim == tp.dim and mesh.size(mesh.ndim - 2) > 1):
        return value
    placements[-2] = StridedShard(fsdp.dim, split_factor=mesh.size(mesh.ndim - 1))
    return value.redistribute(mesh, placements)


def _install_tp_block_chunks() -> None:
    def wrap(chunk):
        def chunk_of_tp_block(tensor, rank, device_mesh):
            out = chunk(tensor, rank, device_mesh)
            return after_tp(out) if isinstance(tensor, DTensor) and out.device_mesh.ndim > 1 else out
        return chunk_of_tp_block

    wrap_once(tp_fsdp_extension, "_chunk_dtensor", wrap, _MARK)


def _install_tp_local_gather() -> None:
    def wrap(gather):
        def gather_tp_local(state_dict, *args, **kwargs):
            with torch.no_grad():
                return gather(_tp_local_state(state_dict), *args, **kwargs)
        return gather_tp_local

    wrap_once(_optim_utils, "_gather_state_dict", wrap, _MARK)


def install() -> None:
    """Make FSDP1's full model state dicts hold whole tensors, its sharded ones chunk each TP
    block, and its optimizer-state loading keep TP-local blocks (idempotent)."""
    _install_no_shard_layout()
    _install_full_state_dict()
    _install_tp_block_chunks()
    _install_tp_local_gather()
