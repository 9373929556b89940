"""The parts of a partial checkpoint as DCP state dicts: the model, the optimizer, user content.

Each part is its own DCP checkpoint directory (one data file per rank plus ``.metadata``), so
each can be loaded alone. The model part is the HF module's own ``state_dict()``, whose sharded
entries are DTensors at their global, TP-degree-independent shapes (GPT-2's fused ``c_attn`` as
[in, 3, out/3]); DCP slices whatever shards the loading layout needs, which is all resharding is.
The optimizer part (``optim_part``) holds the wrapped torch optimizer's states keyed by parameter
name (DTensors like their parameters) plus the loss scaler.

Before any DCP read, the part's keys and global shapes are compared with the checkpoint's
metadata so that every missing / unexpected key and shape mismatch is reported at once.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...compat import flatten_state_dict, set_element
from ...materialize.state_dict import LoadReport
from ...pipeline.split import saved_names
from ...tp.layout import tie_groups
from ..format.plain import to_plain
from ..safety import commit
from ..safety.errors import cause, origin
from ..safety.files import CheckpointFiles
from ..safety.lock import job_lock
from ..safety.safe_load import check_loadable, rebuild, torch_load
from ..save import writer
from ..save.planner import ContiguousSavePlanner
from ..save.stream import named
from .fastread import FastReader, SafeLoadPlanner

USER_CONTENT = "user_content.pt"
CONTIGUOUS = "contiguous"  # manifest "tensor_layout": tensors stored contiguous (fastread's direct path)


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with tied duplicates dropped (the first key of a tie is kept):
    one copy on disk, and the load fills every name of the tie through the shared tensor. On a
    pipeline stage, a weight tied to an earlier stage's goes under that stage's key (both
    stages write the same entry, stored once, and both read it)."""
    state = module.state_dict(keep_vars=True)
    moved = saved_names(module)
    return {moved.get(keys[0], keys[0]): state[keys[0]].detach() for keys in tie_groups(state.items())}


def tied_keys(module: nn.Module) -> dict[str, str]:
    """Dropped duplicate key -> the kept key it shares its tensor with (recorded in the manifest)."""
    local = {key: keys[0] for keys in tie_groups(module.state_dict(keep_vars=True).items()) for key in keys[1:]}
    return {**local, **saved_names(module)}


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened with DCP's own rule, so keys are exactly the checkpoint's entry names
    (``optimizer.state.{param}.exp_avg``, ``optimizer.param_groups.0.lr``...)."""
    return flatten_state_dict(state)[0]


def compare(state: dict[str, Any], files: CheckpointFiles, part: str,
            elsewhere: set[str] = frozenset()) -> LoadReport:
    """Keys and global shapes of ``state`` against the checkpoint's part ``part``; saved keys
    in ``elsewhere`` (other pipeline stages' entries) are not unexpected."""
    saved = files.metadata(part).state_dict_metadata
    flat = flatten(state)
    mismatched = []
    for key in sorted(set(flat) & set(saved)):
        ours, theirs = flat[key], saved[key]
        if isinstance(ours, torch.Tensor) and isinstance(theirs, TensorStorageMetadata) \
                and tuple(ours.shape) != tuple(theirs.size):
            mismatched.append(f"{key}: checkpoint {tuple(theirs.size)}, model {tuple(ours.shape)}")
    return LoadReport(sorted(set(flat) - set(saved)), sorted(set(saved) - set(flat) - set(elsewhere)), mismatched)


def loadable(state: dict[str, Any], report: LoadReport) -> set[str]:
    """The flattened keys of ``state`` that the checkpoint has at the same shape."""
    skip = set(report.missing_keys) | report.mismatched_keys
    return set(flatten(state)) - skip


def write_part(state: dict[str, Any], directory: Path, group=None, drop_behind: bool = True) -> dict[str, dict]:
    """One DCP save (a collective), every tensor stored contiguous so that same-layout loads read
    in place (``fastread``). DCP's own fsync is off: the checksum phase fsyncs every file before
    anything is committed. Returns the size and CRC32 of the files this rank wrote, computed
    while writing, by path relative to ``directory``."""
    try:
        sums = writer.save(state, directory, ContiguousSavePlanner(), group, drop_behind)
        return {Path(p).relative_to(directory).as_posix(): v for p, v in sums.items()}
    except (CheckpointException, OSError) as e:
        root, rank = cause(e), dist.get_rank() if dist.is_initialized() else 0
        if isinstance(root, OSError) and not root.filename and root.errno is not None and origin(e, rank) == rank:
            raise OSError(root.errno, root.strerror or str(root), str(directory / f"__{rank}_0.distcp")) from e
        raise


def read_part(state: dict[str, Any], files: CheckpointFiles, part: str, keys: set[str], planner=None) -> None:
    """One DCP load of the flattened ``keys`` of part ``part`` into ``state`` (a collective):
    tensors in place, other values (hyperparameters, loss scale) put back into the nesting. Every
    file read is verified while it is read (``fastread.FastReader``), so ``state`` must be
    staging: its values are trustworthy only once this returns on every rank. ``planner``: a
    ``SafeLoadPlanner`` of the caller's (``journal.BucketPlanner``)."""
    flat, paths = flatten_state_dict(state)
    subset = {k: flat[k] for k in keys}
    contiguous = files.manifest.get("tensor_layout") == CONTIGUOUS
    dcp.load(subset, storage_reader=FastReader(files, part, contiguous), planner=planner or SafeLoadPlanner())
    for key, value in subset.items():
        if not isinstance(value, torch.Tensor):
            set_element(state, paths[key], value)


def serialize_user_content(obj: Any, trusted: bool = False) -> bytes:
    """The user's object as bytes; unless ``trusted``, only what ``weights_only`` reads back
    (containers with ``defaultdict`` of built-in factories are stored as tagged dicts).

    Raises:
        TypeError: naming what a checkpoint cannot store (before anything is written).
    """
    if trusted:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()
    return check_loadable(to_plain(obj), "user_content")


def stage(path: Path, name: str, held: dict, user_content: Any, trusted: bool) -> tuple[str, bytes]:
    """Global rank 0's share of a save's first phase, in this order: the user content serialized
    (an object a checkpoint cannot store is refused before anything on disk changes), the
    directory's writer lock taken for the job (``lock.job_lock``; ``held`` is the runtime's),
    ``path/name`` checked to be absent or a checkpoint this library wrote, a fresh staging
    directory for ``name`` made. Returns (the staging directory's name, the user content's bytes)."""
    content = serialize_user_content(user_content, trusted)
    job_lock(held, path)
    commit.check_replaceable(path, name)
    return commit.new_staging(path, name).name, content


def write_bytes(path: Path, data: bytes) -> None:
    """Write and fsync one file; an error names it."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise named(e, path) from None


def read_user_content(data: bytes, name: str | Path, trusted: bool = False) -> Any:
    """The user's object from the (verified) bytes of file ``name``, read with ``weights_only``
    (no code runs) unless the caller passed ``trust_user_content=True``, which unpickles freely
    and so runs what the file names."""
    obj = torch_load(io.BytesIO(data), name=str(name), trusted=trusted)
    return obj if trusted else rebuild(obj, name)
