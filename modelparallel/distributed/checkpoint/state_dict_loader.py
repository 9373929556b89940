"""SageMaker v2's ``torch.sagemaker.distributed.checkpoint.state_dict_loader.load``: a DCP
checkpoint loaded over a process group, checked first, read verified, applied all or nothing.

Before any tensor is read, every rank checks the checkpoint against its state dict: every key
present, every tensor the saved shape (global shape for DTensors and ShardedTensors, the local
shape for a local state dict), and for a local (``SM_LOCAL_STATE_DICT``) state dict the sharding
it was saved with. The ranks agree on the outcome, so a mismatch on one rank raises on all of
them, naming the keys, before any collective of the load itself. The read is
``verified_load``'s: only the checkpoint's own files, checksummed, no code run from any of them,
and nothing in the state dict changes unless every rank read everything.

The directory the caller names is resolved once, first (``safe_open.resolve_named``): a
``checkpoint_id`` that is a link (``ckpt/latest -> step_100``) or lies under one (a root linked
to a mounted volume) loads the directory it leads to, since which path to load is the caller's
choice. Inside that directory no link is followed: a data file, ``.metadata`` or manifest that is
a symlink is refused, naming it. Saves are not resolved: a save never replaces a link or writes
through it (``directory.check_replaceable`` names the link; give the directory itself).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, LoadPlanner, StorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...checkpoint.load.staging import why_unwritable
from ...checkpoint.safety.files import CheckpointFiles
from ...checkpoint.safety.safe_open import resolve_named
from ...compat import ShardedTensor, flatten_state_dict
from ...tp.layout import local_part
from ...checkpoint.paused_gc import paused_gc
from . import directories, saving, stages
from .async_utils import wait_for_staging
from .directory import check_manifest_kept, checkpoint_files
from .group_blocks import for_group
from .state_dict_utils import LOCAL_LAYOUT_FILE, check_local_group, local_layouts
from .verified_load import load_all_or_nothing

__all__ = ["load"]


def _problems(state_dict, metadata, check_keys: bool) -> list[str]:
    flat, _ = flatten_state_dict(state_dict)
    saved = metadata.state_dict_metadata
    out = []
    for key, value in flat.items():
        if key not in saved:
            if check_keys:
                out.append(f"{key}: not in the checkpoint")
            continue
        if torch.is_tensor(value):
            md = saved[key]
            parts = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [local_part(value)]
            why = why_unwritable([value] if value.is_meta else parts)
            if why is not None:
                out.append(f"{key}: {why}")
                continue
            if not isinstance(md, TensorStorageMetadata):
                out.append(f"{key}: saved as an object, asked for as a tensor")
            elif tuple(md.size) != tuple(value.size()):
                out.append(f"{key}: saved with shape {tuple(md.size)}, this rank asks for {tuple(value.size())}")
    return out


def _layout_problems(state_dict, files: CheckpointFiles) -> list[str]:
    """A local state dict against the layout recorded when it was saved."""
    wanted = local_layouts(state_dict)
    if not wanted or LOCAL_LAYOUT_FILE not in files.manifest["files"]:
        return []
    try:
        saved = json.loads(files.read(LOCAL_LAYOUT_FILE))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{files.directory / LOCAL_LAYOUT_FILE}: unreadable ({e})") from None
    out = []
    for key, layout in wanted.items():
        old = saved.get(key) if isinstance(saved, dict) else None
        for name in ("fsdp_shard_degree", "tensor_parallel_degree"):
            if isinstance(old, dict) and old.get(name) != layout.get(name):
                out.append(f"{key or 'state dict'}: a local checkpoint saved with {name} {old.get(name)} loads only "
                           f"into the same sharding; this job has {layout.get(name)} (the number of replicas may "
                           "change; save a sharded SHARDED_STATE_DICT checkpoint to change the sharding)")
        if not out and isinstance(old, dict) and "shard" in old and old["shard"] != layout.get("shard"):
            out.append(f"{key or 'state dict'}: this directory holds the local shard with {_words(old['shard'])}, "
                       f"rank {dist.get_rank()} holds the one with {_words(layout.get('shard'))} (same keys and "
                       "shapes, other values): each rank loads the directory its own shard saved; check how the "
                       "directory name is computed")
    return out


def _words(shard) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(shard.items())) if isinstance(shard, dict) else repr(shard)


_READS = ("read_metadata", "read_data", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan")
"""What a storage reader does that the load does itself (so a reader overriding it is refused)."""


def _path_of(checkpoint_id, storage_reader) -> Path:
    """The directory a call names (a file system reader's, or ``checkpoint_id``), as named."""
    if storage_reader is not None and (not isinstance(storage_reader, FileSystemReader) or any(
            getattr(type(storage_reader), m) is not getattr(FileSystemReader, m) for m in _READS)):
        raise NotImplementedError(f"storage_reader={type(storage_reader).__name__}: only file system readers "
                                  "(FileSystemReader, DistributedFileSystemReader) are supported; the load reads "
                                  "their directory with its own verified reader, so one that reads differently "
                                  f"(overrides {', '.join(_READS)}) would be ignored")
    path = checkpoint_id if checkpoint_id is not None else getattr(storage_reader, "path", None)
    if path is None:
        raise ValueError("load needs checkpoint_id (a directory) or storage_reader")
    path = os.fspath(path)
    if "://" in path:
        raise NotImplementedError(f"{path!r}: only file system paths are supported here (S3 is not built)")
    return Path(path)


def _allow_partial(planner: LoadPlanner | None, check_keys: bool) -> bool:
    """Whether keys may be missing; a planner other than DCP's default is refused (its
    ``load_bytes`` could unpickle the checkpoint's entries freely)."""
    if planner is not None and type(planner) is not DefaultLoadPlanner:
        raise NotImplementedError(f"planner={type(planner).__name__}: only DCP's DefaultLoadPlanner (the default) "
                                  "is supported; entries are read with the library's own, which runs no code")
    return not check_keys or bool(planner is not None and planner.allow_partial_load)


@paused_gc()
def load(state_dict, *, checkpoint_id: str | os.PathLike | None = None, storage_reader: StorageReader | None = None,
         planner: LoadPlanner | None = None, process_group: dist.ProcessGroup | None = None,
         check_keys_matched: bool = True, coordinator_rank: int = 0, s3_region: str | None = None,
         s3client_config=None) -> None:
    """Load a checkpoint into ``state_dict``'s tensors, in place (and its plain values).

    Args:
        state_dict: what to load: ``{"model": model.state_dict(), "optimizer": ...}`` under the
            state dict type it was saved with.
        checkpoint_id: the checkpoint directory (or give ``storage_reader``); a link to it, or a
            path through linked directories, is followed once, here (its files are not).
        storage_reader: e.g. ``DistributedFileSystemReader(path)``.
        planner: a DCP ``LoadPlanner`` (default: ``DefaultLoadPlanner``).
        process_group: the ranks that saved it together (default: the world); only they call this.
        check_keys_matched: every key of ``state_dict`` must be in the checkpoint.
        coordinator_rank: a global rank of ``process_group`` (any member coordinates the same).

    Raises:
        CheckpointLoadError: on every rank of the group, naming each key whose shape or sharding
            differs (or that is missing) before anything is read, or the file that failed to
            read or verify; the state dict is then unchanged.
        ValueError: a coordinator outside the group.
        NotImplementedError: S3 options, a reader or planner other than DCP's file system
            reader and default planner.
    """
    if s3_region is not None or s3client_config is not None:
        raise NotImplementedError("s3_region / s3client_config: S3 checkpoints are not built here")
    group = saving.group_of(process_group, coordinator_rank)
    named = _path_of(checkpoint_id, storage_reader)
    path = resolve_named(named)  # once: from here on the real directory, opened link-free inside
    where = str(named) if path == Path(os.path.abspath(named)) else f"{named} (resolved to {path})"
    allow_partial = _allow_partial(planner, check_keys_matched)
    wait_for_staging()  # a save still copying from these tensors must finish that first
    state_dict, restore = stages.qualified(state_dict)  # pipeline stages: their own non-tensor entries
    mine = directories.own_ranks(group, path)  # None unless the ranks name different directories
    with directories.experts_as_blocks(state_dict, mine), for_group(state_dict, group.pg):
        error, files = None, None
        try:
            check_local_group(state_dict, group.members, "load")
            files = checkpoint_files(path)
            check_manifest_kept(files)
            problems = _layout_problems(state_dict, files)
            problems += _problems(state_dict, files.metadata(""), check_keys_matched)
            if problems:
                error = ValueError(f"checkpoint {where}: " + "; ".join(problems))
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = e
        saving.collective_outcome(group, error, f"checkpoint load from {where} (checks)", kind=saving.CheckpointLoadError)
        load_all_or_nothing(state_dict, files, group, allow_partial, where)
    restore()
