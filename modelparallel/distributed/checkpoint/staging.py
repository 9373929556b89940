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
import struct
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, SavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from ...checkpoint.background.stager import Stager
from ...compat import ShardedTensor
from .state_dict_utils import LocalStateDict


def _is_optimizer_state(obj) -> bool:
    return isinstance(obj, Mapping) and "state" in obj and "param_groups" in obj


def _locals(obj) -> list[torch.Tensor]:
    """The memory a (sharded) tensor holds on this rank."""
    if isinstance(obj, DTensor):
        return [obj.to_local()]
    if isinstance(obj, ShardedTensor):
        return [shard.tensor for shard in obj.local_shards()]
    return [obj]


def deferrable(state_dict, memory: list | None = None) -> dict[str, tuple]:
    """The flattened keys (DCP's: path items joined by ``.``) of ``state_dict``'s tensors an
    optimizer step alone changes, each with the aliases whose version counters must be
    watched too (``LocalStateDict.aliases``). ``memory``: gets their local tensors, in order
    (for ``Stager.fingerprint_early``)."""
    out: dict[str, tuple] = {}

    def visit(obj, path: tuple, defer: bool, aliases: tuple = ()) -> None:
        if isinstance(obj, torch.Tensor):  # (DTensors and ShardedTensors are tensors)
            if isinstance(obj, (DTensor, ShardedTensor)) or (defer and obj.dim() > 0):
                out[".".join(path)] = aliases
                if memory is not None:
                    memory.extend(_locals(obj))
        elif isinstance(obj, dict) or isinstance(obj, Mapping):  # a dict is told apart without the ABC's check
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


_ATOMS = (type(None), bool, int, str, bytes)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain_form(obj):
    """``obj``'s exact value as a hashable form, for plain data only (None, bools, ints, floats by
    their bits, strings, bytes, and tuples and lists of them; each tagged with its type, so that
    ``1``, ``1.0`` and ``True`` differ, as ``-0.0`` and ``0.0`` do); None for anything else."""
    kind = type(obj)
    if kind in _ATOMS:
        return kind, obj
    if kind is float:
        return kind, struct.pack("<d", obj)
    if kind in (tuple, list):
        parts = tuple(plain_form(v) for v in obj)
        return None if any(p is None for p in parts) else (kind, parts)
    return None


def _own_serialization(planner: SavePlanner) -> bool:
    """Whether ``planner`` serializes objects as DCP's ``DefaultSavePlanner`` does."""
    return all(getattr(type(planner), name, None) is getattr(DefaultSavePlanner, name)
               for name in ("resolve_data", "lookup_object", "transform_object"))


def _object_bytes(planner: SavePlanner, item, serialized: dict | None) -> bytes:
    """The bytes of a non-tensor item. With ``serialized`` (fqn -> (``plain_form``, bytes) of the
    last save), plain data whose exact value was saved last time reuses its bytes (the optimizer's
    hyperparameters: a ``torch.save`` each, most of staging's time besides the tensors)."""
    obj = form = None
    if serialized is not None:
        obj = planner.lookup_object(item.index)
        form = plain_form(obj)
        last = serialized.get(item.index.fqn)
        if form is not None and last is not None and last[0] == form:
            return last[1]
    data = planner.resolve_data(item) if serialized is None else planner.transform_object(item, obj)
    data = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
    if form is not None:
        serialized[item.index.fqn] = (form, data)
    return data


def _plain(flat: dict | None, item) -> torch.Tensor | None:
    """The tensor DCP's default planner resolves ``item`` to, when it is a plain tensor entry of
    the flattened state dict ``flat`` written whole: one dict lookup, where the planner's goes
    five calls deep for each entry of every save; None for anything else (the planner resolves it)."""
    obj = flat.get(item.index.fqn) if flat is not None else None
    if type(obj) in _PLAIN_TENSORS and not any(item.index.offset or ()):
        return obj
    return None


def stage(planner: SavePlanner, plan, stager: Stager | None, deferred_keys: dict | None = None) -> dict:
    """A host copy of every item ``plan`` writes, in ``stager``'s buffers (reused when an
    earlier save had the same index, shape and dtype): bytes for objects, tensors copied out of
    the model's memory; the tensors of keys in ``deferred_keys`` (key -> aliases to watch) are
    left to ``stager.copy_deferred``. Without a ``stager``: the live tensors (nothing is copied)."""
    staged, deferred_keys = {}, deferred_keys or {}
    own = _own_serialization(planner)
    serialized = stager.serialized if stager is not None and own else None
    flat = getattr(planner, "state_dict", None) if own else None
    if stager is not None:
        stager.begin()
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            staged[item.index] = _object_bytes(planner, item, serialized)
            continue
        data = _plain(flat, item)
        data = planner.resolve_data(item) if data is None else data
        if stager is None:  # a synchronous save writes from the tensors themselves
            staged[item.index] = data.detach()
            continue
        buf = staged[item.index] = stager.buffer((item.index,), data)
        if item.index.fqn in deferred_keys and data.numel() > 0:
            stager.defer(item.index.fqn, data, data, buf, deferred_keys[item.index.fqn])
        else:
            stager.copy_now(data, buf)
    if stager is not None:
        stager.seal()
    return staged
