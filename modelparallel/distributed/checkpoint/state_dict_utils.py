"""SageMaker v2's ``torch.sagemaker.distributed.checkpoint.state_dict_utils``: local state dicts
(``sm_state_dict_type``, ``SMStateDictType.SM_LOCAL_STATE_DICT``) and ``init_optim_state``.

A *local* state dict is what this rank holds, as it holds it, with no communication: each FSDP1
unit's flat parameter shard (the unit's path + ``_flat_param``), each other parameter's local
tensor (a DTensor's shard), each persistent buffer. Its tensors are the model's own memory, so
``load`` into it restores the model in place (SageMaker's example calls nothing after ``load``);
saved with a replication group into one directory per shard, it loads back only into the same
sharding (the same FSDP shard degree and tensor-parallel degree; the number of replicas may
change). The layout is recorded next to the checkpoint and a different one is refused by name.
Other state dict types given to ``sm_state_dict_type`` are FSDP1's own
(``FSDP.state_dict_type``).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from ...checkpoint.safety.safe_load import check_loadable
from ...compat import ShardedTensor
from ...tp.layout import local_part
from ...training.flat_grads import flattened_by_fsdp1, fsdp1_units
from .optim_init import init_optim_state

__all__ = ["LOCAL_LAYOUT_FILE", "LocalStateDict", "SMStateDictType", "check_local_group", "check_plans_agree",
           "init_optim_state", "local_layouts", "sm_state_dict_type"]

LOCAL_LAYOUT_FILE = ".sm_local_layout.json"
_WRAPPER_SEGMENTS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "module"}


class SMStateDictType(enum.Enum):
    """SageMaker's state dict types beyond FSDP's ``StateDictType``."""

    SM_LOCAL_STATE_DICT = "sm_local_state_dict"


class LocalStateDict(dict):
    """A local state dict; ``layout`` is the sharding it only loads back into, ``buffer_keys``
    its entries that are buffers (a forward may change them; the others are parameters)."""

    layout: dict
    buffer_keys: frozenset = frozenset()
    replicas: tuple = ()
    """Global ranks holding the same tensors as this rank (itself included): who may share one
    directory with it."""
    aliases: dict
    """key -> tensors sharing the entry's memory without sharing its version counter (FSDP's
    original parameters over a flat parameter): an in-place change through them is a change."""


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _clean(path: str) -> str:
    """``path`` without the wrappers' segments (FSDP, activation checkpointing, compile)."""
    return ".".join(seg for seg in path.split(".") if seg and seg not in _WRAPPER_SEGMENTS)


def _join(path: str, name: str) -> str:
    path = _clean(path)
    return f"{path}.{name}" if path else name


def _shard_degree(units) -> int | None:
    degrees = {1 if u.sharding_strategy == ShardingStrategy.NO_SHARD else dist.get_world_size(u.process_group)
               for u in units}
    return degrees.pop() if len(degrees) == 1 else None


def _shard_of(units) -> dict:
    """Which shard this rank holds: its place in its FSDP shard group and its tensor- and
    expert-parallel ranks (the same on every replica of the shard, whatever the number of
    replicas). Two shards of one model have the same keys and shapes, so only this tells a
    directory saved by another shard (a directory name computed from the wrong rank)."""
    from ... import runtime

    from ...training.replication import Ranker

    places = {0 if u.sharding_strategy == ShardingStrategy.NO_SHARD else dist.get_rank(u.process_group)
              for u in units}
    shard = {"fsdp_shard_rank": places.pop() if len(places) == 1 else None}
    if runtime.is_initialized():
        if not units:  # FSDP2 (fully_shard) or none: the job's layout says where this rank's shard is
            shard["fsdp_shard_rank"] = Ranker.of(runtime.current()).get_shard_rank()
        shard.update(tensor_parallel_rank=runtime.tp_rank(), expert_parallel_rank=runtime.ep_rank())
    return shard


def local_state_dict(model: nn.Module) -> LocalStateDict:
    """This rank's tensors of ``model``, as it holds them (the model's own memory)."""
    out = LocalStateDict()
    units = fsdp1_units(model)
    names = {id(m): path for path, m in model.named_modules()}
    out.aliases = {}
    for unit in units:
        key = _join(names[id(unit)], "_flat_param")
        out[key] = unit._flat_param.detach()
        out.aliases[key] = tuple(getattr(unit._flat_param, "_params", None) or ())
    for name, p in model.named_parameters():
        if not flattened_by_fsdp1(p):
            out[_clean(name)] = local_part(p).detach()
    buffers = []
    for path, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                buffers.append(_join(path, name))
                out[buffers[-1]] = local_part(b).detach()
    out.buffer_keys = frozenset(buffers)
    from ... import runtime

    tp = runtime.current().config.tensor_parallel_degree if runtime.is_initialized() else 1
    out.replicas = _replicas()
    out.layout = {"fsdp_shard_degree": _shard_degree(units), "tensor_parallel_degree": tp, "shard": _shard_of(units),
                  "shapes": {k: list(v.shape) for k, v in out.items()}}
    return out


def _replicas() -> tuple[int, ...]:
    """This rank's replication group as the job's layout says (``training.replication``); with
    no runtime to ask, this rank alone."""
    from ... import runtime
    from ...training.replication import Ranker

    if not runtime.is_initialized():
        return (dist.get_rank(),)
    return tuple(Ranker.of(runtime.current()).get_rep_group())


_PLAIN_LEAVES = (int, float, bool, str, type(None), torch.dtype)
"""Values the load's allow-list always reads back (exact types: a subclass is checked in full)."""


def check_objects(state_dict) -> None:
    """A save writes no entry its load would refuse: non-tensor entries are read back with an
    allow-list (tensors, numbers, strings, None, lists, tuples, dicts, sets, dtypes), so anything
    else (a numpy scalar, an enum, a dataclass; also ``b""``, which torch's allow-list refuses)
    is refused before anything is written. Numbers, strings, None and dtypes in plain dicts,
    lists and tuples (an optimizer's hyperparameters) pass by their types alone; any other value
    is serialized and read back as the load would (``check_loadable``).

    Raises:
        TypeError: naming the entry and its type.
    """
    def visit(obj, path: str) -> None:
        kind = type(obj)
        if kind in _PLAIN_LEAVES or isinstance(obj, (torch.Tensor, ShardedTensor)):
            return
        if isinstance(obj, dict) or isinstance(obj, Mapping):  # flattened by the save: its own type is not stored
            if not all(type(k) in _PLAIN_LEAVES for k in obj):
                check_loadable(dict(obj), f"state dict entry {path!r}", escape="")
                return
            for k, v in obj.items():
                visit(v, f"{path}.{k}" if path else str(k))
        elif kind in (list, tuple):
            for i, v in enumerate(obj):
                visit(v, f"{path}.{i}" if path else str(i))
        else:
            check_loadable(obj, f"state dict entry {path!r}", escape="")

    visit(state_dict, "")


def check_plans_agree(plans: list, members: list[int]) -> None:
    """Every rank's save plan (``plans``, in the order of ``members``) gives each key one kind,
    shape and dtype. DCP keeps one rank's copy of a plain tensor saved by several (it takes them
    for replicas) and the first rank's size for a sharded one, so a key whose shape differs
    between ranks would lose the others' tensors while the save reports success (and their load
    fail). Values are not compared (that would read every replicated tensor).

    Raises:
        ValueError: naming the first such key and what each rank saves under it.
    """
    seen: dict[str, dict] = {}
    for rank, plan in zip(members, plans):
        for item in plan.items:
            data = item.tensor_data
            kind = "an object" if data is None else f"{tuple(data.size)} {data.properties.dtype}"
            seen.setdefault(item.index.fqn, {}).setdefault(kind, []).append(rank)
    for fqn, kinds in seen.items():
        if len(kinds) > 1:
            raise ValueError(f"state dict entry {fqn!r} differs between the ranks saving it ("
                             + "; ".join(f"ranks {ranks}: {kind}" for kind, ranks in kinds.items()) + "): a key saved "
                             "by several ranks holds one tensor (a replica, or a DTensor's shards); give per-rank "
                             "values their own keys")


def check_local_group(state_dict, members: list[int], what: str = "save") -> None:
    """A local state dict is saved (``what``) or loaded only over ranks holding the same
    tensors (a replication group, one directory per shard): over ranks holding different shards,
    DCP would keep one rank's tensors under each key and every other rank's load would get them.

    Raises:
        ValueError: naming the group and the ranks in it that hold other tensors.
    """
    for key, value in (state_dict.items() if isinstance(state_dict, dict) else ()):
        if isinstance(value, LocalStateDict):
            _check_replicas(str(key), value.replicas, members, what)
    if isinstance(state_dict, LocalStateDict):
        _check_replicas("state dict", state_dict.replicas, members, what)


def _check_replicas(key: str, replicas: tuple, members: list[int], what: str) -> None:
    others = sorted(set(members) - set(replicas))
    if others:
        raise ValueError(f"a local (SM_LOCAL_STATE_DICT) {what} of {key!r} over the process group {sorted(members)}: "
                         f"ranks {others} hold other shards than rank {dist.get_rank()} (which shares its tensors "
                         f"with ranks {list(replicas)} only); save and load each shard's directory over its "
                         "replication group (state.ranker.get_rep_groups()), or save a sharded state dict")


def load_local_state_dict(model: nn.Module, state_dict, strict: bool = True) -> LoadResult:
    """Copy ``state_dict`` (a local state dict) into ``model``'s tensors.

    Raises:
        ValueError: a shape that differs (another sharding), or with ``strict`` a missing or
            unexpected key, naming each.
    """
    mine = local_state_dict(model)
    missing = sorted(set(mine) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(mine))
    wrong = [f"{k}: saved {tuple(v.shape)}, this rank holds {tuple(mine[k].shape)}"
             for k, v in state_dict.items() if k in mine and tuple(v.shape) != tuple(mine[k].shape)]
    if wrong or (strict and (missing or unexpected)):
        raise ValueError("local (SM_LOCAL_STATE_DICT) state dict does not fit this model's sharding: "
                         + "; ".join(wrong + [f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected]))
    from .async_utils import wait_for_staging  # (imports this module)

    wait_for_staging()  # a save still copying from the model's tensors must finish that first
    with torch.no_grad():
        for k, v in state_dict.items():
            if k in mine and v is not mine[k] and v.data_ptr() != mine[k].data_ptr():
                mine[k].copy_(v)
    return LoadResult(missing, unexpected)


@contextlib.contextmanager
def _local(model: nn.Module) -> Iterator[None]:
    model.state_dict = lambda *a, **k: local_state_dict(model)
    model.load_state_dict = lambda state_dict, strict=True, **k: load_local_state_dict(model, state_dict, strict)
    try:
        yield
    finally:
        del model.state_dict, model.load_state_dict


@contextlib.contextmanager
def sm_state_dict_type(model: nn.Module, state_dict_type, state_dict_config=None,
                       optim_state_dict_config=None) -> Iterator[None]:
    """Within the block, ``model.state_dict()`` / ``load_state_dict`` use ``state_dict_type``:
    ``SMStateDictType.SM_LOCAL_STATE_DICT`` (local tensors, no communication) or one of FSDP's
    ``StateDictType`` values (as ``FSDP.state_dict_type(model, ...)``).

    Raises:
        TypeError: for another kind of state dict type.
    """
    if state_dict_type is SMStateDictType.SM_LOCAL_STATE_DICT:
        with _local(model):
            yield
        return
    if not isinstance(state_dict_type, enum.Enum) or type(state_dict_type).__name__ != "StateDictType":
        raise TypeError(f"sm_state_dict_type: {state_dict_type!r} is neither SMStateDictType.SM_LOCAL_STATE_DICT "
                        "nor an FSDP StateDictType")
    with FullyShardedDataParallel.state_dict_type(model, state_dict_type, state_dict_config, optim_state_dict_config):
        yield


def local_layouts(state_dict) -> dict:
    """Layouts of the local state dicts among ``state_dict``'s values (and itself), by key."""
    if isinstance(state_dict, LocalStateDict):
        return {"": state_dict.layout}
    if not isinstance(state_dict, dict):
        return {}
    return {str(k): v.layout for k, v in state_dict.items() if isinstance(v, LocalStateDict)}
