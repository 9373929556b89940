"""SageMaker's single-file full checkpoint: ``resume_from_checkpoint(path, tag="fullmodel.pt",
partial=False)`` where ``path/fullmodel.pt`` is a ``torch.save``d state dict.

The v1 fine-tuning recipe saves a pretrained model's ``state_dict()`` on rank 0 and resumes it
on every rank. The file may hold Hugging Face keys (translated with the architecture's own
table) or this library's distributed keys (used as they are); ``user_content_{tag}`` next to
it, if present, is returned. Both are read with ``weights_only=True`` (memory-mapped, so each
rank copies only its own shards), so no code in them runs. Keys and shapes are checked before
any weight changes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..materialize import state_dict as sd_mod
from ..tp.layout import copy_shard
from . import commit, parts
from .errors import run_phase
from .full import translation
from .full_load import _compare
from .parts import LoadReport
from .pending import PendingResume
from .safe_load import torch_load


def is_single_file(path: Path, tag: str) -> bool:
    """Whether ``path/tag`` is a file (rank 0's view, shared: rank 0 may have just written it)."""
    return bool(run_phase("resume (locate)", lambda: (Path(path) / tag).is_file())[0])


def prepare(path: Path, tag: str, strict: bool, translate_function: Callable | None,
            trusted: bool) -> tuple[Any, PendingResume]:
    """(user content or None, the pending load of ``path/tag``)."""
    def content():
        commit.safe_name(path, tag, "the tag")
        user = path / f"user_content_{tag}"
        if not user.is_file():
            return None
        return parts.read_user_content(user, trusted)

    found: dict[str, Any] = {}
    run_phase("resume (user content)", lambda: found.update(content=content()))
    load = lambda model, _: run_phase(  # noqa: E731
        "full load (weights)", lambda: load_file(path / tag, model, strict, translate_function))[0]
    return found["content"], PendingResume(lambda model: None, load)


def _sources(whole: dict[str, Any], model) -> tuple[dict[str, tuple[str, str, tuple]], Callable | None]:
    """distributed key -> (stored key, stored key, global shape), and the HF translation used
    (None when the file already holds the model's own keys at the model's shapes)."""
    state = parts.model_state(model.module)
    shapes = {k: tuple(t.shape) for k, t in state.items()}
    shapes.update({alias: shapes[kept] for alias, kept in parts.tied_keys(model.module).items()})
    from_hf = translation(getattr(getattr(model.module, "config", None), "model_type", None), False)
    if from_hf is None or all(shapes.get(k) == tuple(t.shape) for k, t in whole.items()):
        return {k: (k, k, tuple(t.shape)) for k, t in whole.items()}, None
    out = {}
    for key, t in whole.items():
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        for dist_key, m in from_hf(key, meta):
            out[dist_key] = (key, key, tuple(m.shape))
    return out, from_hf


def load_file(file: Path, model, strict: bool, translate_function: Callable | None = None) -> LoadReport:
    """Load the state dict in ``file`` into ``model`` (no collectives).

    Raises:
        ValueError: the file is not a state dict of tensors, or (strict) it does not fit:
            every missing / unexpected key and shape mismatch listed, before anything is copied.
    """
    whole = torch_load(file, mmap=True)
    if not isinstance(whole, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in whole.items()):
        raise ValueError(f"{file}: expected a state dict (parameter name -> tensor), got {type(whole).__name__}")
    if translate_function is not None:
        return sd_mod.load_state_dict(model.module, translate_function(whole), strict=strict)
    state = parts.model_state(model.module)
    sources, from_hf = _sources(whole, model)
    report = _compare(state, sources, parts.tied_keys(model.module))
    problems = report.problems("model")
    if problems and strict:
        raise ValueError(f"{file} does not fit the model (strict=True):\n  - " + "\n  - ".join(problems))
    skip = report.mismatched_keys
    for key, target in state.items():
        if key in sources and key not in skip:
            stored = sources[key][1]
            items = dict(from_hf(stored, whole[stored]) if from_hf else [(stored, whole[stored])])
            copy_shard(target, items.get(key, next(iter(items.values()))))
    return report
