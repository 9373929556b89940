"""State-dict translation between Hugging Face format and the distributed format, one table each.

The distributed format keeps HF's module names; it differs only where the plan stores a fused
weight with an explicit chunk dimension (GPT-2's ``c_attn``: HF [in, 3*out] <-> ours
[in, 3, out]), so both formats are independent of the TP degree. A ``KeyTable`` lists every key an
architecture may carry (templates, ``{}`` = layer index), the packed ones, the tied aliases and the
legacy buffers old HF checkpoints stored. Unknown keys raise, naming the key and the architecture:
nothing is silently dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KeyTable:
    """One architecture's key mapping.

    Attributes:
        arch: the HF ``model_type``.
        base_prefix: attribute name of the base model inside head models (``transformer``).
        base_keys: templates relative to the base model.
        head_keys: templates relative to the head model (LM head, MLM head, classifier).
        packed: template -> (dim, chunks): HF concatenates ``chunks`` equal parts along ``dim``;
            the distributed format keeps them as a separate dimension at ``dim``.
        tied: HF key -> the key it shares storage with (filled in on export when absent).
        legacy_buffers: template (relative to the base model) -> ``fn(max_seq_len, layer_index,
            config)`` building a buffer older HF checkpoints stored (``config``: the model's, or
            None); dropped on import, added on export only when asked for.
        stored_as: model key -> the key HF's ``save_pretrained`` writes for it, where HF renames on
            save and back on load (GPT-NeoX's ``lm_head.weight`` is stored as ``embed_out.weight``);
            exports write the stored key, imports accept either.
        stacked: template of a mixture-of-experts tensor stacked over experts (expert index
            first, as transformers 5 holds it in memory and both formats store it) -> the
            templates (``{}`` = layer, then expert) of the per-expert tensors checkpoints on the
            Hugging Face hub hold instead, concatenated in this order along each expert's first
            dimension (Mixtral's ``w1 | w3`` = gate | up). Read on import, never written.
        renamed: hub template -> template, for keys hub checkpoints name differently (Mixtral's
            ``block_sparse_moe`` is transformers 5's ``mlp``). Read on import, never written.
    """

    arch: str
    base_prefix: str
    base_keys: tuple[str, ...]
    head_keys: tuple[str, ...] = ()
    packed: dict[str, tuple[int, int]] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    legacy_buffers: dict[str, Callable[[int, int, object], torch.Tensor]] = field(default_factory=dict)
    stored_as: dict[str, str] = field(default_factory=dict)
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)

    def model_key(self, key: str) -> str:
        """The model's key for a checkpoint key (undoing ``stored_as``)."""
        return next((m for m, stored in self.stored_as.items() if stored == key), key)

    def expert_keys(self, key: str, experts: int) -> list[list[str]]:
        """Where a hub checkpoint keeps stacked experts tensor ``key``: one list of keys (experts
        0..experts-1) per concatenated part; [] for any other key."""
        try:
            prefix, template, layer = self.match(key)
        except KeyError:
            return []
        return [[prefix + t.format(layer, e) for e in range(experts)] for t in self.stacked.get(template, ())]

    def hub_names(self, key: str) -> list[str]:
        """The names a hub checkpoint may give ``key`` (``renamed``); [] when it keeps ours."""
        try:
            prefix, template, layer = self.match(key)
        except KeyError:
            return []
        return [prefix + hub.format(layer) for hub, ours in self.renamed.items() if ours == template]

    def match(self, key: str) -> tuple[str, str, str | None]:
        """(prefix, template, layer index) of ``key``; raises ``KeyError`` for unknown keys."""
        for template in self.head_keys:
            layer = _match(template, key)
            if layer is not False:
                return "", template, layer
        prefix, rel = ("", key)
        if key.startswith(self.base_prefix + "."):
            prefix, rel = self.base_prefix + ".", key[len(self.base_prefix) + 1:]
        for template in (*self.base_keys, *self.legacy_buffers):
            layer = _match(template, rel)
            if layer is not False:
                return prefix, template, layer
        raise KeyError(f"{key!r} is not a key of a {self.arch} model (base prefix {self.base_prefix!r}); "
                       "is this state dict of another architecture?")


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


def _match(template: str, key: str):
    m = _pattern(template).match(key)
    if m is None:
        return False
    return m.group(1) if m.groups() else None


def _template(table: KeyTable, key: str) -> str | None:
    """The template of ``key``, or None for a legacy buffer (not stored in either format)."""
    _, template, _ = table.match(key)
    return None if template in table.legacy_buffers else template


def to_hf_items(table: KeyTable, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One distributed-format entry as HF entries ([] for keys HF does not store)."""
    template = _template(table, key)
    if template is None:
        return []
    if template in table.packed:
        dim = table.packed[template][0]
        tensor = tensor.flatten(dim, dim + 1)
    return [(table.stored_as.get(key, key), tensor)]


def from_hf_items(table: KeyTable, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One HF entry in distributed format ([] for legacy buffers, which the model recomputes)."""
    key = table.model_key(key)
    template = _template(table, key)
    if template is None:
        return []
    if template in table.packed:
        dim, chunks = table.packed[template]
        if tensor.shape[dim] % chunks:
            raise ValueError(f"{key}: dim {dim} of shape {tuple(tensor.shape)} does not split into {chunks} "
                             f"fused chunks ({table.arch})")
        tensor = tensor.unflatten(dim, (chunks, -1))
    return [(key, tensor)]


def _legacy(table: KeyTable, state_dict: dict, max_seq_len: int, config) -> dict[str, torch.Tensor]:
    layers, prefix = set(), ""
    for key in state_dict:
        p, template, layer = table.match(key)
        if layer is not None and template in table.base_keys:
            layers.add(int(layer))
            prefix = p
    return {prefix + template.format(i): build(max_seq_len, i, config)
            for template, build in table.legacy_buffers.items() for i in sorted(layers)}


def to_hf(table: KeyTable, state_dict: dict, max_seq_len: int | None = None,
          legacy_buffers: bool = False, config=None) -> dict[str, torch.Tensor]:
    """A full distributed-format state dict in HF format, tied aliases included.

    Hugging Face transformers 5 models hold no causal-mask buffers, so by default ``max_seq_len``
    adds nothing and the result loads with ``load_state_dict(strict=True)``; ``legacy_buffers=True``
    adds the per-layer masks that models of older transformers releases stored, sized
    ``max_seq_len`` (``config``, the model's, decides per-layer details such as local windows).

    Raises:
        KeyError: naming the first key that is not of this architecture.
        ValueError: ``legacy_buffers`` without ``max_seq_len``.
    """
    if legacy_buffers and max_seq_len is None:
        raise ValueError("legacy_buffers=True needs max_seq_len: the masks are max_seq_len x max_seq_len")
    out = {}
    for key, tensor in state_dict.items():
        out.update(to_hf_items(table, key, tensor))
    for alias, source in table.tied.items():
        alias = table.stored_as.get(alias, alias)
        if alias not in out and source in out:
            out[alias] = out[source]
    if legacy_buffers:
        out.update(_legacy(table, state_dict, max_seq_len, config))
    return out


def _hub_pattern(template: str) -> re.Pattern:
    return re.compile("^(.*?)" + re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


def from_hub(table: KeyTable, state_dict: dict) -> dict:
    """``state_dict`` with a hub checkpoint's per-expert tensors stacked and its renamed keys
    renamed (``KeyTable.stacked`` / ``renamed``); other entries as they are."""
    out, parts = {}, {}
    for key, tensor in state_dict.items():
        for template, hubs in table.stacked.items():
            found = next(((i, m) for i, h in enumerate(hubs) if (m := _hub_pattern(h).match(key))), None)
            if found:
                i, m = found
                parts.setdefault(m.group(1) + template.format(m.group(2)), {})[(i, int(m.group(3)))] = tensor
                break
        else:
            renamed = next((m.group(1) + ours.format(*m.groups()[1:]) for hub, ours in table.renamed.items()
                            if (m := _hub_pattern(hub).match(key))), None)
            out[renamed or key] = tensor
    for key, pieces in parts.items():
        n_parts, experts = 1 + max(i for i, _ in pieces), 1 + max(e for _, e in pieces)
        if len(pieces) != n_parts * experts:
            raise KeyError(f"{key}: the checkpoint holds {len(pieces)} of its {n_parts} x {experts} per-expert tensors")
        out[key] = torch.stack([torch.cat([pieces[(i, e)] for i in range(n_parts)]) for e in range(experts)])
    return out


def from_hf(table: KeyTable, state_dict: dict) -> dict[str, torch.Tensor]:
    """An HF state dict in distributed format (loadable by ``DistributedModel`` at any degree);
    a hub checkpoint's per-expert tensors are stacked first.

    Raises:
        KeyError: naming every key that is not of this architecture.
    """
    unknown, out = [], {}
    for key, tensor in from_hub(table, state_dict).items():
        try:
            out.update(from_hf_items(table, key, tensor))
        except KeyError:
            unknown.append(key)
    if unknown:
        raise KeyError(f"keys not of a {table.arch} model: {unknown}")
    return out


def causal_mask(max_seq_len: int, layer: int, config=None) -> torch.Tensor:
    """The [1, 1, n, n] lower-triangular mask older GPT-2/GPT-J checkpoints stored per layer."""
    return torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool)).view(1, 1, max_seq_len, max_seq_len)


def masked_bias(value: float) -> Callable[[int, int], torch.Tensor]:
    """The scalar fill value older checkpoints stored beside the mask."""
    return lambda max_seq_len, layer, config=None: torch.tensor(value)
