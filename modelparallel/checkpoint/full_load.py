"""Loading a full checkpoint's weights into a sharded model, one tensor at a time.

Each rank opens the safetensors files (memory-mapped), translates each entry to the distributed
format and copies only its own shard: no communication and no rank holds the whole model. Keys
and shapes are compared first, from the headers alone, so a strict load that cannot succeed
copies nothing.

A user ``translate_function`` (SageMaker's whole-state-dict translators, e.g.
``translate_hf_state_dict_to_smdistributed_gpt2``) needs the whole state dict at once; with one,
every rank reads all weights into memory and loads through ``DistributedModel.load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..materialize import state_dict as sd_mod
from ..materialize.safetensors_io import DTYPES, load_all, open_file
from ..pipeline.split import elsewhere
from ..tp.layout import copy_shard
from . import parts
from .full import translation
from .parts import LoadReport


def _sources(directory: Path, files: list[str], from_hf) -> dict[str, tuple[str, str, tuple]]:
    """distributed key -> (file, stored key, global shape), from the headers only."""
    out = {}
    for name in files:
        with open_file(directory / name) as f:
            for key in f.keys():
                piece = f.get_slice(key)
                meta = torch.empty(piece.get_shape(), dtype=DTYPES[piece.get_dtype()], device="meta")
                for dist_key, t in (from_hf(key, meta) if from_hf else [(key, meta)]):
                    out[dist_key] = (name, key, tuple(t.shape))
    return out


def _compare(state: dict[str, torch.Tensor], sources: dict, ties: dict[str, str],
             others: set[str] = frozenset()) -> LoadReport:
    """Keys and shapes; a stored tie alias (``lm_head.weight``) stands for the key it is tied to;
    ``others``: keys other pipeline stages load."""
    for alias, kept in ties.items():
        if alias in sources and kept not in sources:
            sources[kept] = sources.pop(alias)
    extra = sorted(k for k in sources if k not in state and k not in ties and k not in others)
    mismatched = [f"{k}: checkpoint {sources[k][2]}, model {tuple(t.shape)}"
                  for k, t in state.items() if k in sources and sources[k][2] != tuple(t.shape)]
    return LoadReport(sorted(set(state) - set(sources)), extra, mismatched)


def load_weights(directory: Path, manifest: dict, model, strict: bool,
                 translate_function: Callable | None = None) -> LoadReport:
    """Load the weights of the full checkpoint in ``directory`` into ``model`` (no collectives).

    Raises:
        ValueError: with ``strict``, listing every missing / unexpected key and shape mismatch,
            before anything is copied.
    """
    files = [f for f in manifest["weights"] if f.endswith(".safetensors")]
    if translate_function is not None:
        return _load_whole(directory, files, model, strict, translate_function)
    from_hf = translation(manifest.get("model_type"), False) if manifest["translated"] else None
    state = parts.model_state(model.module)
    sources = _sources(directory, files, from_hf)
    report = _compare(state, sources, parts.tied_keys(model.module), elsewhere(model.module))
    problems = report.problems("model")
    if problems and strict:
        raise ValueError("checkpoint does not fit (strict=True):\n  - " + "\n  - ".join(problems))
    skip = report.mismatched_keys
    wanted: dict[str, list[tuple[str, str]]] = {}
    for key in state:
        if key in sources and key not in skip:
            name, stored, _ = sources[key]
            wanted.setdefault(name, []).append((key, stored))
    for name, entries in wanted.items():
        with open_file(directory / name) as f:
            for key, stored in entries:
                items = dict(from_hf(stored, f.get_tensor(stored)) if from_hf else [(stored, f.get_tensor(stored))])
                copy_shard(state[key], items.get(key, next(iter(items.values()))))
    return report


def _load_whole(directory: Path, files: list[str], model, strict: bool, translate_function) -> LoadReport:
    whole = {}
    for name in files:
        whole.update(load_all(directory / name))
    result = sd_mod.load_state_dict(model.module, translate_function(whole), strict=strict)
    return result
