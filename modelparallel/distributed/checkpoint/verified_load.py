"""A v2 load, all or nothing: read into copies, verified, agreed on, then applied.

DCP's own load reads into the state dict's tensors as it goes, with ``FileSystemReader``: it
unpickles ``.metadata`` and non-tensor entries freely (a crafted file runs code), opens any path
the metadata names (``../x``, an absolute path, a FIFO that blocks forever) and, when a file is
short, leaves the tensors read before the failure overwritten. Here:

1. the files are the checkpoint's as committed (``directory.checkpoint_files``) in the directory
   the caller named, resolved once by ``state_dict_loader.load`` (a ``latest`` link followed
   there, never here): the manifest's list, each a regular file inside the directory opened once
   without following links (a symlinked data file is refused, naming it), its size
   and CRC32 checked on the bytes read (``fastread.FastReader``); ``.metadata`` through the
   allow-list unpickler and non-tensor entries with ``weights_only`` (``SafeLoadPlanner``);
2. the tensors are read into fresh copies (the state dict is untouched);
3. the ranks of the group agree on the outcome: an error anywhere is raised on every rank,
   leading with the first failing rank's message (which names the file);
4. only then are the copies copied into the state dict's tensors (local memory copies, which
   cannot fail half-way for I/O reasons) and the plain values put in place.

The copies cost one more copy of the state being loaded, for the length of the load.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ...checkpoint.load.fastread import FastReader, SafeLoadPlanner
from ...checkpoint.safety.files import CheckpointFiles
from ...checkpoint.load.staging import like
from ...compat import ShardedTensor, flatten_state_dict, set_element
from ...tp.layout import local_part
from .outcome import CheckpointLoadError, Group, collective_outcome


def _copy_of(value):
    """A tensor to read into like ``value`` (same shards for a DTensor; a ShardedTensor is
    copied whole: its own deep copy keeps its shards and group, with no collective)."""
    if isinstance(value, ShardedTensor):
        return copy.deepcopy(value)
    return like(value)


def _is_tensor(value) -> bool:
    return isinstance(value, (torch.Tensor, ShardedTensor))


def _apply(live, staged) -> None:
    """Copy a staged tensor into the live one, shard by shard (no collective)."""
    if isinstance(live, ShardedTensor):
        for dst, src in zip(live.local_shards(), staged.local_shards()):
            dst.tensor.detach().copy_(src.tensor)
        return
    dst = local_part(live) if isinstance(live, DTensor) else live
    src = local_part(staged) if isinstance(staged, DTensor) else staged
    with torch.no_grad():
        dst.detach().copy_(src)


def load_all_or_nothing(state_dict, files: CheckpointFiles, group: Group, allow_partial: bool,
                        where: str | None = None) -> None:
    """Load ``files`` (one DCP directory) into ``state_dict`` over ``group``, all or nothing.
    ``where``: the checkpoint as the caller named it, for the error (default: its directory).

    Raises:
        CheckpointLoadError: on every rank of ``group``, when any rank's read or check failed
            (its first line names the file); ``state_dict`` is then unchanged.
    """
    flat, paths = flatten_state_dict(state_dict)
    staged = {k: _copy_of(v) if _is_tensor(v) else v for k, v in flat.items()}
    error = None
    try:
        dcp_load(staged, storage_reader=FastReader(files, "", contiguous=False),
                 planner=SafeLoadPlanner(allow_partial_load=allow_partial), process_group=group.pg)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must hear of it
        error = e
    collective_outcome(group, error, f"checkpoint load from {where or files.directory}", kind=CheckpointLoadError)
    for key, value in flat.items():
        if _is_tensor(value):
            _apply(value, staged[key])
        elif staged[key] is not value:
            set_element(state_dict, paths[key], staged[key])
