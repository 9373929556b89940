"""SageMaker v2's ``torch.sagemaker.utils.module_utils``: the two helpers its documented custom
``init_method_using_config`` uses to give one module's meta tensors storage."""

from __future__ import annotations

import torch
from torch import nn

from ...materialize import meta


def _modules(module: nn.Module, recurse: bool):
    return module.modules() if recurse else [module]


def empty_module_params(module: nn.Module, device: torch.device | None = None, recurse: bool = False) -> nn.Module:
    """Give ``module``'s meta parameters uninitialized storage on ``device`` (default: the CPU),
    each ``Parameter`` object kept (ties and optimizer references survive); a DTensor gets
    storage for this rank's shard. Parameters holding data are left alone. Returns ``module``."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    for mod in _modules(module, recurse):
        for p in mod._parameters.values():
            if p is not None and meta.is_meta(p):
                torch.utils.swap_tensors(p, nn.Parameter(meta.empty_like_on(p, device), requires_grad=p.requires_grad))
    return module


def move_buffers_to_device(module: nn.Module, device: torch.device, recurse: bool = False) -> nn.Module:
    """Move ``module``'s buffers to ``device``; a buffer on meta gets uninitialized storage
    there (the init method must then write it). Returns ``module``."""
    device = torch.device(device)
    for mod in _modules(module, recurse):
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = meta.empty_like_on(b, device) if meta.is_meta(b) else b.to(device)
    return module
