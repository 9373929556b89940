"""What a full checkpoint writes when asked for a precision: fp32 or the training dtype.

A model trained in fp16/bf16 has two versions of each weight: the half-precision parameter the
forward pass used and the optimizer's fp32 master. Exporting fp32 writes the masters (the
weights as the optimizer knows them, not half-precision values widened); exporting a half
dtype rounds the masters once. Integer buffers are never cast.
"""

from __future__ import annotations

import torch

from ..load import parts

EXPORT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                 "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def check_dtype(dtype) -> torch.dtype | None:
    """``dtype`` as a torch dtype (None: the parameters' own).

    Raises:
        ValueError: for anything but float32, float16 or bfloat16 (a dtype or its name).
    """
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in EXPORT_DTYPES:
        return EXPORT_DTYPES[dtype]
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    raise ValueError(f"dtype={dtype!r}: a full checkpoint is exported in torch.float32, torch.float16 or "
                     "torch.bfloat16 (or None: the training dtype)")


def export_state(model, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The model's state dict (ties dropped, as ``parts.model_state``) in ``dtype``: parameters
    with an fp32 master are taken from it. Casting works shard by shard (no communication)."""
    state = parts.model_state(model.module)
    if dtype is None:
        return state
    masters = {id(p): m for opt in model.linked_optimizers for p, m in opt.master_weights.pairs}
    params = dict(model.module.named_parameters())
    out = {}
    for key, t in state.items():
        src = masters.get(id(params.get(key)), t).detach()
        out[key] = src.to(dtype) if src.is_floating_point() and src.dtype != dtype else src
    return out
