"""Shard-on-read loading: an HF safetensors checkpoint into a (meta-built) distributed model.

Every rank reads only the block of each tensor it holds, so no rank ever holds the full model:
a block that is one byte range of the file (row shards, replicated tensors) is read straight into
the shard's memory (``safetensors_io``); other blocks through ``safe_open(...).get_slice``, with
the file opened per tensor so the memory map of the pages read is dropped as soon as the block
is copied. The steps: check every key and shape
(nothing is allocated if one is wrong) -> give the loaded tensors storage -> copy each block ->
initialize what the checkpoint does not hold (non-persistent buffers such as rotary
``inv_freq``, causal masks, position ids; with ``strict=False`` missing weights) with the model's
own HF init -> guard: raise naming anything still on meta.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from . import hf_init, meta, safetensors_io, stacked
from .init_engine import InitEngine
from ..models import architecture_for
from ..pipeline.split import elsewhere, saved_names
from ..tp.layout import base_prefix, block_of, block_slices, local_part, tie_groups
from .state_dict import LoadReport

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Entry:
    """One tensor of the model and where its data is in the checkpoint."""

    names: list[str]  # the model's keys holding this tensor (several for a tie)
    target: torch.Tensor
    key: str  # checkpoint key
    file: str
    packed: tuple[int, int] | None  # (dim, chunks) when the model stores a fused dim split
    parts: list[list[str]] | None = None  # a hub checkpoint's per-expert keys of a stacked experts tensor


def checkpoint_files(path: str | Path) -> dict[str, str]:
    """Checkpoint key -> safetensors file, for a file, a directory with ``model.safetensors`` or
    a sharded directory with ``model.safetensors.index.json``.

    Raises:
        FileNotFoundError: naming the path when it holds no checkpoint, or the index and the
            shard it names that does not exist.
        ValueError: naming the file, for an unreadable index, a shard name that leaves the
            directory (absolute, ``..``) or a damaged safetensors file.
    """
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / INDEX).is_file():
        return _indexed_files(path / INDEX)
    elif (path / SINGLE).is_file():
        files = [path / SINGLE]
    else:
        raise FileNotFoundError(f"{path}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read "
                                "shard by shard; save with save_pretrained(..., safe_serialization=True))")
    out = {}
    for f in files:
        with safetensors_io.open_file(str(f)) as h:
            out.update({k: str(f) for k in h.keys()})
    return out


def _indexed_files(index: Path) -> dict[str, str]:
    """Key -> shard file of a sharded checkpoint's index, every named shard checked to exist."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{index}: not a JSON object ({e})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no 'weight_map' object (checkpoint key -> shard file)")
    for key, f in weight_map.items():
        parts = f.split("/") if isinstance(f, str) else []
        if not parts or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
            raise ValueError(f"{index}: weight_map names {f!r} for {key!r}; a shard is a file inside "
                             f"{index.parent} (no absolute path, no '..')")
    files = {k: str(index.parent / f) for k, f in weight_map.items()}
    for f in sorted(set(files.values())):
        if not Path(f).is_file():
            raise FileNotFoundError(f"{index}: names shard {f}, which does not exist")
    return files


def _metadata(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint key -> (shape, safetensors dtype name), every file opened once."""
    by_file: dict[str, list[str]] = {}
    for key, f in files.items():
        by_file.setdefault(f, []).append(key)
    out = {}
    for f, keys in by_file.items():
        with safetensors_io.open_file(f) as h:
            for k in keys:
                try:
                    sl = h.get_slice(k)
                except SafetensorError:
                    raise ValueError(f"{f}: no tensor {k}, which the index places in this file") from None
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def _kind(dtype: torch.dtype | str) -> str:
    """"float", "int", "bool" or "complex": values of one kind are cast on read, across kinds never.
    A torch dtype, or a safetensors name (``F32``, ``BF16``, ``F8_E4M3``, ``I64``, ``U8``, ``BOOL``)."""
    if isinstance(dtype, str):
        return {"B": "bool" if dtype == "BOOL" else "float", "F": "float", "C": "complex"}.get(dtype[0], "int")
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "complex" if dtype.is_complex else "int"


def _packed_dims(module: nn.Module) -> dict[int, int]:
    """id(tensor) -> the dim a packed style split in two, for every packed parameter of
    ``module``: the dims of the architecture's ``Packed`` descriptor, which the style records."""
    out = {}
    for mod in module.modules():
        for name, dim in mod.__dict__.get("_mp_packed_dims", {}).items():
            if getattr(mod, name, None) is not None:
                out[id(getattr(mod, name))] = dim
    return out


def _packed(dim: int | None, model_shape: tuple, ckpt_shape: tuple) -> tuple[int, int] | None:
    """(dim, chunks) when the model stores ``ckpt_shape`` with fused dim ``dim`` split per chunk
    (None for a checkpoint that already holds the split layout)."""
    if dim is None or len(model_shape) != len(ckpt_shape) + 1:
        return None
    return dim, model_shape[dim]


def _hf_shape(shape: tuple, packed) -> tuple:
    if packed is None:
        return tuple(shape)
    d = packed[0]
    return (*shape[:d], shape[d] * shape[d + 1], *shape[d + 2:])


def _candidates(module: nn.Module, key: str, table=None) -> list[str]:
    """Checkpoint keys that may hold model key ``key`` (a head model's checkpoint read into its
    base model, or the reverse, differ by the base-model prefix; HF may store it renamed, as the
    key table's ``stored_as`` says)."""
    inner, declared = base_prefix(module), getattr(module, "base_model_prefix", "")
    out = [key] + ([table.stored_as[key]] if table is not None and key in table.stored_as else [])
    if inner:
        if key.startswith(inner + "."):
            out.append(key[len(inner) + 1:])
    elif declared:
        out.append(f"{declared}.{key}")
    return out


def plan(module: nn.Module, files: dict[str, str], strict: bool) -> tuple[list[Entry], LoadReport]:
    """Match every model tensor with its checkpoint tensor and check shapes and dtype kinds; raise
    ``ValueError`` naming every problem (file and key) before anything is allocated."""
    metadata = _metadata(files)
    shapes = {k: shape for k, (shape, _) in metadata.items()}
    table = getattr(architecture_for(module), "table", None)
    packed_dims = _packed_dims(module)
    state = module.state_dict(keep_vars=True)
    moved = saved_names(module)  # a weight tied across pipeline stages: also under its first stage's key
    entries, problems, missing, used = [], [], [], set()
    for names in tie_groups(state.items()):
        t = state[names[0]]
        names_ = names + [moved[n] for n in names if n in moved]
        key = next((c for n in names_ for c in _candidates(module, n, table) if c in shapes), None)
        if key is None and table is not None:
            parts = stacked.expert_parts(table, names[0], t, shapes, files, problems)
            if parts is not None:  # a hub checkpoint's experts, one tensor per expert
                first = parts[0][0]
                if first in metadata and _kind(metadata[first][1]) != _kind(t.dtype):
                    problems.append(f"{files[first]}: {first}: the checkpoint holds dtype {metadata[first][1]}, "
                                    f"the model {t.dtype}")
                used.update(k for part in parts for k in part)
                entries.append(Entry(names, t, first, files.get(first, ""), None, parts))
                continue
            key = next((k for n in names for k in table.hub_names(n) if k in shapes), None)
        if key is None:
            missing.extend(names)
            continue
        used.add(key)
        packed = _packed(packed_dims.get(id(t)), tuple(t.shape), shapes[key])
        if _hf_shape(t.shape, packed) != shapes[key]:
            problems.append(f"{files[key]}: {key}: the checkpoint holds shape {shapes[key]}, the model (its "
                            f"config) expects {_hf_shape(t.shape, packed)}")
        if _kind(metadata[key][1]) != _kind(t.dtype):
            problems.append(f"{files[key]}: {key}: the checkpoint holds dtype {metadata[key][1]}, the model "
                            f"{t.dtype} (only casts within floating-point or integer dtypes are made on read)")
        entries.append(Entry(names, t, key, files[key], packed))
    others = {c for k in elsewhere(module) for c in _candidates(module, k)}  # other pipeline stages read them
    unexpected = sorted(k for k in shapes if k not in used and k not in others and not _ignored(module, table, k))
    if strict and (missing or unexpected):
        problems.insert(0, f"missing keys {sorted(missing)}; unexpected keys {unexpected}")
    if problems:
        raise ValueError("cannot load the checkpoint:\n  - " + "\n  - ".join(problems))
    return entries, LoadReport(sorted(missing), unexpected)


def _ignored(module: nn.Module, table, key: str) -> bool:
    """Checkpoint keys HF itself skips: the model's ``_keys_to_ignore_on_load_unexpected``, old
    stored masks (the key table's legacy buffers) and stored copies of non-persistent buffers."""
    patterns = getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []
    if any(re.search(p, key) for p in patterns):
        return True
    if table is not None:
        try:
            if table.match(key)[1] in table.legacy_buffers:
                return True
        except KeyError:
            pass
    buffers = {n.rpartition(".")[2] for n, _ in module.named_buffers()}
    return key.rpartition(".")[2] in buffers


def read_block(handle, key: str, target: torch.Tensor, packed) -> torch.Tensor:
    """This rank's block of checkpoint tensor ``key`` for ``target`` (a DTensor's local shard, or
    the whole tensor), reading only that block; a fused dim is read chunk by chunk."""
    shape, offset = block_of(target)
    sl = handle.get_slice(key)
    if packed is None:
        return sl[block_slices(shape, offset)]
    d, n = packed[0], target.shape[packed[0] + 1]
    head = block_slices(shape[:d], offset[:d])
    tail = block_slices(shape[d + 2:], offset[d + 2:])
    pieces = [sl[(*head, slice(c * n + offset[d + 1], c * n + offset[d + 1] + shape[d + 1]), *tail)]
              for c in range(offset[d], offset[d] + shape[d])]
    return torch.stack(pieces, d) if pieces else torch.empty(shape)


def _give_storage(module: nn.Module, target: torch.Tensor, device) -> torch.Tensor:
    """Storage for one meta tensor (parameters keep their identity; a buffer is replaced in
    every module holding it). Returns the tensor to copy into."""
    if not meta.is_meta(target):
        return target
    if isinstance(target, nn.Parameter):
        torch.utils.swap_tensors(target, nn.Parameter(meta.empty_like_on(target, device),
                                                      requires_grad=target.requires_grad))
        return target
    new = meta.empty_like_on(target, device)
    for mod in module.modules():
        for k, b in mod._buffers.items():
            if b is target:
                mod._buffers[k] = new
    return new


def load_hf_checkpoint(model: nn.Module, path: str | Path, strict: bool = True) -> LoadReport:
    """Load the HF safetensors checkpoint at ``path`` into ``model``, each rank reading only its
    shards. ``model`` may be a ``DistributedModel``, a model sharded by ``smp.transform`` or a
    plain one, built on the meta device (expected: nothing is allocated before the read) or not.
    Takes no collective.

    Raises:
        ValueError: naming every missing/unexpected key (when ``strict``) and every shape that
            does not match the model's config, before anything is allocated.
        MetaTensorError: naming any parameter or buffer nothing could initialize.
    """
    from .. import runtime

    module = getattr(model, "module", model)
    device = runtime.current().device if runtime.is_initialized() else torch.device("cpu")
    files = checkpoint_files(path)
    entries, result = plan(module, files, strict)
    loaded = []
    with torch.no_grad():
        for e in entries:
            target = _give_storage(module, e.target, device)
            loaded.append(target)
            dst = local_part(target)
            if e.parts is not None:
                dst.copy_(stacked.read_stacked(files, e.parts, target))
                continue
            if e.packed is None and safetensors_io.read_into(e.file, e.key, dst, *block_of(target)):
                continue  # one byte range read straight into the shard
            with safetensors_io.open_file(e.file) as h:
                dst.copy_(read_block(h, e.key, target, e.packed))
    if meta.has_meta(module):  # non-persistent buffers, and missing weights when not strict
        with hf_init.frozen(loaded):
            initer = InitEngine(module, device=device)
            with initer.validate_params_and_buffers_inited():
                initer.init_all(match_eager=False)
    meta.check_no_meta(module, "after loading the checkpoint")
    return result
