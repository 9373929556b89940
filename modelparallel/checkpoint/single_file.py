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

import contextlib
import io
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import runtime
from .background import async_full
from .format import export_dtype, layouts
from .format.layouts import translation
from .load import parts
from .load.full_load import stage_whole
from .load.journal import Policy
from .load.pending import PendingResume
from .load.staging import agreed
from .safety import commit
from .safety.errors import cause, run_phase
from .safety.files import open_inside, read_from
from .safety.lease import BUSY, read_lease
from .safety.lock import job_lock
from .safety.safe_load import torch_load
from .save import full

logger = logging.getLogger("modelparallel")


def is_single_file(path: Path, tag: str) -> bool:
    """Whether ``path/tag`` is a regular file (not a symlink; rank 0's view, shared: rank 0 may
    have just written it)."""
    def check():
        try:
            return stat.S_ISREG(os.stat(Path(path) / tag, follow_symlinks=False).st_mode)
        except OSError:
            return False

    return bool(run_phase("resume (locate)", check)[0])


def _read_plain(path: Path, name: str) -> bytes | None:
    """The bytes of file ``path/name`` (opened once, without following a symlink), None if absent."""
    try:
        fd = open_inside(path, name, "the tag")
    except FileNotFoundError:
        return None
    try:
        return read_from(fd, path / name)
    finally:
        os.close(fd)


def prepare(path: Path, tag: str, strict: bool, translate_function: Callable | None,
            trusted: bool, policy: Policy | None = None) -> tuple[Any, PendingResume]:
    """(user content or None, the pending load of ``path/tag``; ``policy``: staging in memory
    or through an undo journal)."""
    def content():
        commit.safe_name(path, tag, "the tag")
        name = f"user_content_{tag}"
        data = _read_plain(path, name)
        return None if data is None else parts.read_user_content(data, path / name, trusted)

    found: dict[str, Any] = {}
    run_phase("resume (user content)", lambda: found.update(content=content()))

    def load(model):
        return agreed("full load (weights)", lambda: stage_file(path, tag, model, strict, translate_function, policy))

    return found["content"], PendingResume(load)


def _translation(whole: dict[str, Any], model) -> Callable | None:
    """The translation to use: None when the file already holds the model's own keys at the
    model's shapes; else the architecture's HF table, or the unsharded layout's (packed
    projections merged) for a model without one."""
    state = parts.model_state(model.module)
    shapes = {k: tuple(t.shape) for k, t in state.items()}
    shapes.update({alias: shapes[kept] for alias, kept in parts.tied_keys(model.module).items()})
    if all(shapes.get(k) == tuple(t.shape) for k, t in whole.items()):
        return None
    model_type = getattr(getattr(model.module, "config", None), "model_type", None)
    return layouts.for_load(model.module, layouts.HF if translation(model_type, False) else layouts.UNSHARDED,
                            model_type)


def stage_file(path: Path, tag: str, model, strict: bool, translate_function: Callable | None = None,
               policy: Policy | None = None):
    """Read the state dict in ``path/tag`` and stage it for ``model`` (no collectives).

    Raises:
        ValueError: the file is not a state dict of tensors, or (strict) it does not fit:
            every missing / unexpected key and shape mismatch listed, before anything is copied.
    """
    file = path / tag
    fd = open_inside(path, tag, "the tag")  # a regular file, no symlink, one link
    try:
        with read_lease(fd) as lease:  # held until every tensor is copied out of the mapping
            whole = _load_descriptor(fd, file, mapped=lease != BUSY)
            if not isinstance(whole, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in whole.items()):
                raise ValueError(f"{file}: expected a state dict (parameter name -> tensor), "
                                 f"got {type(whole).__name__}")
            if translate_function is not None:
                return stage_whole(model, translate_function(whole), strict, None, str(file), policy=policy)
            return stage_whole(model, whole, strict, _translation(whole, model), str(file), policy=policy)
    finally:
        os.close(fd)


def _load_descriptor(fd: int, file: Path, mapped: bool = True) -> Any:
    """``torch_load`` of the file open as ``fd``, never reopened by its name: memory-mapped
    through ``/proc/self/fd`` (the open file itself, whatever its name now points to; the caller
    holds a read lease, see ``safety/lease.py``), else (not ``mapped``: the file is open for
    writing somewhere, so a mapping could change or vanish under the load) read from the
    descriptor."""
    proc = Path(f"/proc/self/fd/{fd}")
    if mapped and proc.exists():
        return torch_load(str(proc), name=str(file), mmap=True)
    if not mapped:
        logger.warning("%s is open for writing by another process: read into memory, not mapped", file)
    return torch_load(io.BytesIO(read_from(fd, file)), name=str(file))


FILE_SUFFIXES = (".pt", ".pth", ".bin")
"""A full checkpoint whose tag ends so is SageMaker's single-file form (``fullmodel.pt``)."""


def is_file_tag(tag) -> bool:
    return isinstance(tag, str) and tag.endswith(FILE_SUFFIXES)


def save(path: Path, tag: str, model, user_content: Any, translate_if_full: bool, trusted: bool = False,
         dtype: torch.dtype | None = None, saver=None) -> Path:
    """SageMaker's single-file full checkpoint (a collective): ``path/tag``, a ``torch.save``d
    state dict (Hugging Face keys for a built-in architecture, else the unsharded module's), and
    ``path/user_content_{tag}``. Tensors are streamed to rank 0 like a directory export, but the
    format holds them in one pickle, so rank 0 holds the whole model once. Written to a temporary
    file, fsynced, renamed; ``newest`` last. With an ``async_save.AsyncSaver`` the writing runs in
    its background thread (as ``full.save``'s)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout, translate = layouts.for_save(model.module, translate_if_full)
    state = export_dtype.export_state(model, dtype)
    found: dict[str, Any] = {}

    def prepare():
        if rank == 0:
            found["content"] = parts.serialize_user_content(user_content, trusted)
            job_lock(runtime.current().held_locks, path)
            commit.check_replaceable(path, tag, single_file=True)
            commit.clean_leftovers(path)

    run_phase("full save (prepare)", prepare)
    if saver is not None:
        held = async_full.Collected(state) if rank == 0 else None
        run_phase("full save (gather)", lambda: async_full.raise_error(full.stream(state, translate, held)))
        async_full.in_background(saver, tag, path, lambda: _commit(path, tag, _Collector(dict(held.items)),
                                                               found["content"], None) if rank == 0 else None)
        return path / tag
    collected = _Collector() if rank == 0 else None
    error = full.stream(state, translate, collected)
    run_phase("full save (write)", lambda: _commit(path, tag, collected, found.get("content"), error)
              if rank == 0 else None)
    return path / tag


class _Collector:
    """What ``full.stream`` writes into on rank 0: the state dict to save."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None):
        self.tensors: dict[str, torch.Tensor] = tensors or {}

    def write(self, key: str, tensor: torch.Tensor) -> None:
        self.tensors[key] = tensor.detach().cpu().contiguous()


def _commit(path: Path, tag: str, collected: _Collector, content: bytes, error: Exception | None) -> None:
    if error is not None:
        raise error
    tmp = path / commit.hidden_name("tmp", commit.new_nonce(), tag)
    try:
        with open(tmp, "wb") as f:
            torch.save(collected.tensors, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / tag)
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise commit.named(cause(e) if isinstance(cause(e), OSError) else e, path / tag) from e
    commit.fsync_path(path)
    commit.write_file_atomic(path / f"user_content_{tag}", content)
    commit.write_newest(path, tag)
