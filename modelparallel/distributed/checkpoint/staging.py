"""Staging a v2 save: which tensors an asynchronous save may copy after it returns, the copy
itself, and the planner the writer thread reads the copies through.

``async_save`` is handed state dicts, not the model or the optimizer. Their tensors are the
training's own memory (a local state dict's, an optimizer's ``state_dict()``'s) or copies FSDP
made. Copying all of them in the call is most of the time an asynchronous save blocks; copying
them in the background thread is safe for the tensors only an optimizer step changes, as long
as the next step waits for the copy (every optimizer of the process is held until staging is
done, ``AsyncSaver.submit(hold_every_optimizer=True)``). Those are recognized by where they sit:

* the tensors under an optimizer state dict's ``"state"`` (a mapping with ``"state"`` and
  ``"param_groups"``), step counters (scalars) excepted;
* sharded parameters: DTensors and ShardedTensors (FSDP's and tensor parallelism's);
* a local state dict's parameter entries (``LocalStateDict.buffer_keys`` names the others); an
  FSDP flat parameter's original parameters are watched with it (``LocalStateDict.aliases``).

Everything else (buffers a forward may update, plain values) is copied in the call. A deferred
tensor changed in place some other way before its copy fails that save on every rank, naming it
(``Stager.copy_deferred``'s version check): never a checkpoint mixing two steps.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint import SavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from ...checkpoint.background.async_save import Stager
from ...compat import ShardedTensor
from .state_dict_utils import LocalStateDict


def _is_optimizer_state(obj) -> bool:
    return isinstance(obj, Mapping) and "state" in obj and "param_groups" in obj


def deferrable(state_dict) -> dict[str, tuple]:
    """The flattened keys (DCP's: path items joined by ``.``) of ``state_dict``'s tensors an
    optimizer step alone changes, each with the aliases whose version counters must be
    watched too (``LocalStateDict.aliases``)."""
    out: dict[str, tuple] = {}

    def visit(obj, path: tuple, defer: bool, aliases: tuple = ()) -> None:
        if isinstance(obj, (DTensor, ShardedTensor)) or (isinstance(obj, torch.Tensor) and defer and obj.dim() > 0):
            out[".".join(path)] = aliases
        elif isinstance(obj, Mapping):
            optimizer = _is_optimizer_state(obj)
            local = isinstance(obj, LocalStateDict)
            for k, v in obj.items():
                below = defer or (optimizer and k == "state") or (local and k not in obj.buffer_keys)
                visit(v, (*path, str(k)), below, getattr(obj, "aliases", {}).get(k, ()) if local else ())
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, (*path, str(i)), defer)

    visit(state_dict, (), False)
    return out


class StagedPlanner(SavePlanner):
    """The planner the background writer sees: hands out the staged snapshot of each item."""

    def __init__(self, staged: dict):
        self.staged = staged

    def resolve_data(self, write_item):
        data = self.staged[write_item.index]
        return io.BytesIO(data) if isinstance(data, bytes) else data

    def set_up_planner(self, *args, **kwargs):
        raise RuntimeError("a staged planner only resolves data")

    def create_local_plan(self):
        raise RuntimeError("a staged planner only resolves data")

    def create_global_plan(self, all_plans):
        raise RuntimeError("a staged planner only resolves data")

    def finish_plan(self, new_plan):
        raise RuntimeError("a staged planner only resolves data")


def stage(planner: SavePlanner, plan, stager: Stager | None, deferred_keys: dict | None = None) -> dict:
    """A host copy of every item ``plan`` writes, in ``stager``'s buffers (reused when an
    earlier save had the same index, shape and dtype): bytes for objects, tensors copied out of
    the model's memory; the tensors of keys in ``deferred_keys`` (key -> aliases to watch) are
    left to ``stager.copy_deferred``. Without a ``stager``: the live tensors (nothing is copied)."""
    staged, deferred_keys = {}, deferred_keys or {}
    if stager is not None:
        stager.copied_bytes = stager.deferred_bytes = 0
    for item in plan.items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            staged[item.index] = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            continue
        data = data.detach()
        if stager is None:  # a synchronous save writes from the tensors themselves
            staged[item.index] = data
            continue
        buf = staged[item.index] = stager.buffer((item.index,), data)
        if item.index.fqn in deferred_keys and data.numel() > 0:
            stager.defer(item.index.fqn, data, data, buf, deferred_keys[item.index.fqn])
        else:
            stager.copy_now(data, buf)
    return staged
