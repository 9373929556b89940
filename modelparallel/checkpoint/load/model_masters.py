"""Fp32 master weights that a checkpoint keeps in its model part, not its optimizer part.

A job whose parameters are fp32 while it computes in half precision (sharded data parallelism
keeps fp32 shards and casts for compute) saves no separate masters: its model part holds the
fp32 values it stepped. Resumed where the parameters are half precision with fp32 masters beside
them (tensor parallelism with ``fp16``/``bf16``), the masters would be recreated from the
half-precision weights, rounded (about 3e-5 off on GPT-2's embedding), and training would not go
on from the numbers the saving job had. So those masters are read from the model part.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...pipeline.split import saved_names
from .optim_part import MASTERS, read_target, param_names

MASTERS_KEY = MASTERS.rstrip(".")


def plan(module: nn.Module, optimizer, nested: dict, model_metadata) -> dict[str, tuple[str, torch.Tensor]]:
    """Model-part key -> (parameter name, an fp32 target placed like the parameter) for every live
    master the optimizer part (``nested``, as planned) does not hold, when the model part stores
    each of them in fp32 at the master's shape; else ``{}``: then all are recreated from the
    weights, as before, with ``load_masters``' warning (a part of them read here and the others
    kept as they were would leave stale masters)."""
    saved = nested.get(MASTERS_KEY, {})
    names, stored_as = param_names(module), saved_names(module)
    entries = model_metadata.state_dict_metadata
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for p, master in optimizer.master_weights.params_and_masters():
        name = names[id(p)]
        if master is p or name in saved:
            continue
        key = stored_as.get(name, name)
        md = entries.get(key)
        if not (isinstance(md, TensorStorageMetadata) and md.properties.dtype == torch.float32
                and tuple(md.size) == tuple(master.shape)):
            return {}
        out[key] = (name, read_target(p, md))
    return out


def merge(nested: dict, read: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Put the masters ``read`` (by ``plan``, then read) where the optimizer part's would be."""
    masters = nested.setdefault(MASTERS_KEY, {})
    for name, target in read.values():
        masters[name] = {"master": target}
