"""Loading optimizer state into PyTorch FSDP1 (``FullyShardedDataParallel``) wrapped around
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
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..compat import fsdp_optim_utils as _optim_utils

_MARK = "_mp_tp_local"


def tp_local(value):
    """``value`` gathered over all mesh dimensions but the last, as a local tensor; anything
    that is not a DTensor on a mesh of 2+ dimensions is returned unchanged."""
    if not isinstance(value, DTensor) or value.device_mesh.ndim < 2:
        return value
    placements = [Replicate()] * (value.device_mesh.ndim - 1) + [value.placements[-1]]
    return value.redistribute(value.device_mesh, placements).to_local()


def _tp_local_state(state):
    if isinstance(state, dict):
        return {k: _tp_local_state(v) for k, v in state.items()}
    return tp_local(state)


def install() -> None:
    """Make FSDP1's optimizer-state loading keep TP-local blocks (idempotent)."""
    gather = _optim_utils._gather_state_dict
    if getattr(gather, _MARK, False):
        return

    @functools.wraps(gather)
    def gather_tp_local(state_dict, *args, **kwargs):
        with torch.no_grad():
            return gather(_tp_local_state(state_dict), *args, **kwargs)

    setattr(gather_tp_local, _MARK, True)
    _optim_utils._gather_state_dict = gather_tp_local
