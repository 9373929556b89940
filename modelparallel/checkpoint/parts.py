"""The parts of a partial checkpoint as DCP state dicts: the model, the optimizer, user content.

Each part is its own DCP checkpoint directory (one data file per rank plus ``.metadata``), so
each can be loaded alone. The model part is the HF module's own ``state_dict()``, whose sharded
entries are DTensors at their global, TP-degree-independent shapes (GPT-2's fused ``c_attn`` as
[in, 3, out/3]); DCP slices whatever shards the loading layout needs, which is all resharding is.
The optimizer part is ``get_optimizer_state_dict`` of the wrapped torch optimizer (states keyed
by parameter name, DTensors like their parameters) plus the loss scaler.

Before any DCP read, the part's keys and global shapes are compared with the checkpoint's
metadata so that every missing / unexpected key and shape mismatch is reported at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's key rule: one place
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from . import fp16_states
from .fastread import ContiguousSavePlanner, FastReader

USER_CONTENT = "user_content.pt"


class LoadReport(NamedTuple):
    """What a non-strict load skipped: keys the model (or optimizer) has and the checkpoint
    lacks, keys only the checkpoint has, and ``"key: checkpoint (..), model (..)"`` shape
    mismatches."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_shapes: list[str]

    def problems(self, part: str) -> list[str]:
        out = [f"{part}: missing keys (in the model, not in the checkpoint): {self.missing_keys}"] \
            if self.missing_keys else []
        if self.unexpected_keys:
            out.append(f"{part}: unexpected keys (in the checkpoint, not in the model): {self.unexpected_keys}")
        out += [f"{part}: shape mismatch {m}" for m in self.mismatched_shapes]
        return out


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with tied duplicates dropped (the first key of a tie is kept):
    one copy on disk, and the load fills every name of the tie through the shared tensor."""
    seen, out = set(), {}
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[key] = t.detach()
    return out


def tied_keys(module: nn.Module) -> dict[str, str]:
    """Dropped duplicate key -> the kept key it shares its tensor with (recorded in the manifest)."""
    first, ties = {}, {}
    for key, t in module.state_dict(keep_vars=True).items():
        ties.update({key: first[id(t)]} if id(t) in first else {})
        first.setdefault(id(t), key)
    return ties


def optimizer_state(module: nn.Module, optimizer, load_from: Path | None = None) -> dict[str, Any]:
    """The optimizer part: per-parameter-name states (initialized if the optimizer never
    stepped, so a fresh optimizer has every slot to load into) and the loss scaler; with fp32
    master weights, ``fp16_states`` builds it (``load_from``: the part about to be read)."""
    if fp16_states.has_masters(optimizer):
        return fp16_states.optimizer_state(module, optimizer, load_from)
    inner = optimizer.optimizer
    grads = {}
    if not inner.state:  # DCP only initializes states when no gradient is set: set them aside
        grads = {p: p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None}
        for p in grads:
            p.grad = None
    try:
        osd = get_optimizer_state_dict(module, inner)
    finally:
        for p, g in grads.items():
            p.grad = g
    return {"optimizer": osd, "loss_scaler": optimizer.loss_scaler.state_dict()}


def apply_optimizer_state(module: nn.Module, optimizer, state: dict[str, Any]) -> None:
    if fp16_states.has_masters(optimizer):
        return fp16_states.apply(optimizer, state)
    set_optimizer_state_dict(module, optimizer.optimizer, state["optimizer"])
    optimizer.loss_scaler.load_state_dict(state["loss_scaler"])


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened with DCP's own rule, so keys are exactly the checkpoint's entry names
    (``optimizer.state.{param}.exp_avg``, ``optimizer.param_groups.0.lr``...)."""
    return flatten_state_dict(state)[0]


def compare(state: dict[str, Any], directory: Path) -> LoadReport:
    """Keys and global shapes of ``state`` against the DCP checkpoint in ``directory``."""
    saved = FileSystemReader(directory).read_metadata().state_dict_metadata
    flat = flatten(state)
    mismatched = []
    for key in sorted(set(flat) & set(saved)):
        ours, theirs = flat[key], saved[key]
        if isinstance(ours, torch.Tensor) and isinstance(theirs, TensorStorageMetadata) \
                and tuple(ours.shape) != tuple(theirs.size):
            mismatched.append(f"{key}: checkpoint {tuple(theirs.size)}, model {tuple(ours.shape)}")
    return LoadReport(sorted(set(flat) - set(saved)), sorted(set(saved) - set(flat)), mismatched)


def loadable(state: dict[str, Any], report: LoadReport) -> set[str]:
    """The flattened keys of ``state`` that the checkpoint has at the same shape."""
    skip = set(report.missing_keys) | {m.split(": ")[0] for m in report.mismatched_shapes}
    return set(flatten(state)) - skip


def write_part(state: dict[str, Any], directory: Path) -> None:
    """One DCP save (a collective), every tensor stored contiguous so that same-layout loads read
    in place (``fastread``). DCP's own fsync is off: the checksum phase fsyncs every file while
    it computes the CRC, before anything is committed (``commit.file_checksum``)."""
    dcp.save(state, storage_writer=FileSystemWriter(directory, sync_files=False), planner=ContiguousSavePlanner())


def read_part(state: dict[str, Any], directory: Path, keys: set[str], contiguous: bool = False) -> None:
    """One DCP load of the flattened ``keys`` into ``state`` (a collective): tensors in place,
    other values (hyperparameters, loss scale) put back into the nesting. ``contiguous``: the
    part was written by ``write_part`` with ``ContiguousSavePlanner`` (the direct read applies)."""
    flat, paths = flatten_state_dict(state)
    subset = {k: flat[k] for k in keys}
    dcp.load(subset, storage_reader=FastReader(directory, contiguous))
    for key, value in subset.items():
        if not isinstance(value, torch.Tensor):
            set_element(state, paths[key], value)


def write_user_content(obj: Any, directory: Path, name: str = USER_CONTENT) -> None:
    with open(directory / name, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def read_user_content(path: Path) -> Any:
    """The user's object (any picklable object, so not ``weights_only``: a checkpoint is trusted
    like the code that wrote it, and its checksum was verified first)."""
    return torch.load(path, map_location="cpu", weights_only=False)
