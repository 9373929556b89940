"""The layouts a full checkpoint stores its tensors in, and the per-key translations to and from
the model's own (distributed) state dict.

* ``"hf"``: Hugging Face's keys and shapes, through the architecture's key table (what
  ``from_pretrained`` loads). Built-in architectures only.
* ``"unsharded"``: the model's own keys at the shapes of the module before ``DistributedModel``
  sharded it: a fused projection sharded per chunk (``packed_colwise``, stored by the model as
  ``[..., chunks, n, ...]``) is merged back to ``[..., chunks * n, ...]``. What a model without a
  key table saves (``smp.nn`` modules, modules registered with ``tp_register_with_module``, an
  architecture without a table), so the unsharded module's ``load_state_dict`` takes it as is.
* ``"distributed"``: the model's own keys at its global (DTensor) shapes, chunks kept apart
  (``translate_if_full=False`` on a built-in architecture, as before).

A translation maps one key and tensor to a list of (key, tensor): ``Items``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Items = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
HF, UNSHARDED, DISTRIBUTED = "hf", "unsharded", "distributed"


def translation(model_type: str | None, to_hf: bool) -> Items | None:
    """The per-key translation (distributed -> HF, or back) of an architecture, or None."""
    from ...models import table_for
    from ...models._hf_items import from_hf_items, to_hf_items

    if model_type is None or table_for(model_type) is None:
        return None
    fn = to_hf_items if to_hf else from_hf_items
    return lambda key, tensor: fn(model_type, key, tensor)


def packed_keys(module: nn.Module) -> dict[str, int]:
    """State-dict key -> the dim a packed style split in two (``[..., chunks, n, ...]``), for
    every packed tensor of ``module`` (the dims its style recorded as ``_mp_packed_dims``)."""
    out = {}
    for prefix, mod in module.named_modules():
        for name, dim in mod.__dict__.get("_mp_packed_dims", {}).items():
            if getattr(mod, name, None) is not None:
                out[f"{prefix}.{name}" if prefix else name] = dim
    return out


def to_unsharded(module: nn.Module) -> Items:
    """Distributed -> unsharded layout: packed dims merged."""
    packed = packed_keys(module)

    def items(key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        d = packed.get(key)
        return [(key, t if d is None else t.flatten(d, d + 1))]

    return items


def from_unsharded(module: nn.Module) -> Items:
    """Unsharded -> distributed layout: a packed dim split into (chunks, n) when the stored
    tensor has the merged shape (a tensor already in the distributed shape passes through)."""
    packed = packed_keys(module)
    chunks = {k: t.shape[d] for k, t in module.state_dict(keep_vars=True).items() if (d := packed.get(k)) is not None}

    def items(key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        d = packed.get(key)
        if d is None or t.dim() != module.get_parameter(key).dim() - 1 or t.shape[d] % chunks[key]:
            return [(key, t)]
        return [(key, t.unflatten(d, (chunks[key], -1)))]

    return items


def for_save(module: nn.Module, translate_if_full: bool) -> tuple[str, Items | None]:
    """(layout, translation from the model's state dict) a full save of ``module`` uses."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    hf = translation(model_type, True)
    if hf is not None:
        return (HF, hf) if translate_if_full else (DISTRIBUTED, None)
    return UNSHARDED, to_unsharded(module) if packed_keys(module) else None


def for_load(module: nn.Module, layout: str, model_type: str | None) -> Items | None:
    """The translation from a full checkpoint's ``layout`` to ``module``'s state dict."""
    if layout == HF:
        return translation(model_type, False)
    return from_unsharded(module) if packed_keys(module) else None
