"""Meta-device helpers: find tensors without storage, give them storage, and say which are left.

A model built on the meta device (``torch.device("meta")``, ``accelerate.init_empty_weights()``)
has shapes but no data, so it can be sharded before any memory is spent. The steps after
sharding (initialize, load, sync from rank 0) all start by giving each rank's shard storage and
end with the same guard: every parameter and buffer still on meta is named in one error, instead
of surfacing later as garbage (a rotary ``inv_freq`` left empty trains from a loss of 3.6
instead of 11, with no error).

Parameters get storage by ``torch.utils.swap_tensors``, so each ``Parameter`` object stays the
same: ties (one parameter held by two modules), FSDP's references and hooks survive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..tp.layout import from_local_like, local_part


# torch's own ``Module.register_parameter``, taken when this package is imported. accelerate's
# ``init_empty_weights()`` replaces it for the block's duration with one that re-creates every
# registered parameter through its class's constructor on the meta device, which fails for a
# DTensor parameter (its constructor takes a spec).
_TORCH_REGISTER_PARAMETER = nn.Module.register_parameter


@contextlib.contextmanager
def torch_parameter_registration() -> Iterator[None]:
    """Inside, modules register parameters as torch does, also within accelerate's
    ``init_empty_weights()``: sharding registers each parameter's DTensor on the device the
    model's tensor already had (a model built under ``init_empty_weights`` is on meta and stays
    there)."""
    current = nn.Module.register_parameter
    if current is _TORCH_REGISTER_PARAMETER:
        yield
        return
    nn.Module.register_parameter = _TORCH_REGISTER_PARAMETER
    try:
        yield
    finally:
        nn.Module.register_parameter = current


class MetaTensorError(RuntimeError):
    """Raised when a step needs real tensors and finds meta ones, or the reverse."""


def is_meta(t: torch.Tensor | None) -> bool:
    """True for a tensor (or a DTensor's local shard) with no storage."""
    if t is None:
        return False
    return local_part(t).is_meta


def named_tensors(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(qualified name, owner module, attribute, tensor) of every parameter and buffer,
    non-persistent buffers included; a tensor held by several modules appears once per holder."""
    for path, mod in module.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is not None:
                    yield (f"{path}.{name}" if path else name), mod, name, t


def meta_names(module: nn.Module) -> list[str]:
    """Names of every parameter and buffer of ``module`` still on the meta device."""
    return sorted({q for q, _, _, t in named_tensors(module) if is_meta(t)})


def has_meta(module: nn.Module) -> bool:
    return any(is_meta(t) for _, _, _, t in named_tensors(module))


def check_no_meta(module: nn.Module, what: str = "the model") -> None:
    """Raise naming every parameter and buffer of ``module`` still on meta (the final guard of
    every delayed-init path)."""
    left = meta_names(module)
    if left:
        raise MetaTensorError(f"{what}: {len(left)} parameters/buffers are still on the meta device "
                              f"(never initialized or loaded): {', '.join(left)}")


def empty_like_on(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized tensor with ``t``'s (global) shape and layout on ``device``: for a DTensor,
    storage for this rank's shard only."""
    dtype = dtype or t.dtype
    if isinstance(t, DTensor):
        return from_local_like(torch.empty(t.to_local().shape, dtype=dtype, device=device), t)
    return torch.empty(t.shape, dtype=dtype, device=device)


def materialize(module: nn.Module, device: torch.device, recurse: bool = True) -> list[str]:
    """Give every meta parameter and buffer of ``module`` uninitialized storage on ``device``
    (this rank's shard for DTensors), keeping parameter identity; return the names materialized.

    Tensors that already hold data are left as they are.
    """
    done: dict[int, torch.Tensor] = {}
    names = []
    modules = module.named_modules(remove_duplicate=False) if recurse else [("", module)]
    for path, mod in modules:
        for name, p in list(mod._parameters.items()):
            if p is not None and is_meta(p) and id(p) not in done:
                new = nn.Parameter(empty_like_on(p, device), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, new)
                done[id(p)] = p
                names.append(f"{path}.{name}" if path else name)
        for name, b in list(mod._buffers.items()):
            if b is not None and is_meta(b):
                if id(b) not in done:
                    done[id(b)] = empty_like_on(b, device)
                    names.append(f"{path}.{name}" if path else name)
                mod._buffers[name] = done[id(b)]
    return names


def to_meta_(module: nn.Module) -> dict[str, torch.Tensor]:
    """Move every real parameter and buffer of ``module`` to meta in place (parameter identity
    kept) and return their former data by qualified name (each holder of a tie listed)."""
    kept: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for qname, mod, name, t in list(named_tensors(module)):
        if id(t) in kept:
            out[qname] = kept[id(t)]
            continue
        if is_meta(t):
            continue
        data = t.detach()
        if isinstance(t, nn.Parameter):
            torch.utils.swap_tensors(t, nn.Parameter(torch.empty_like(t, device="meta"),
                                                     requires_grad=t.requires_grad))
        else:
            meta = torch.empty_like(t, device="meta")
            for m in module.modules():  # a buffer shared by several modules stays shared
                for k, b in m._buffers.items():
                    if b is t:
                        m._buffers[k] = meta
        kept[id(t)] = data
        out[qname] = data
    return out
