"""SageMaker's v1.6-1.9 checkpoint API: ``smp.save(obj, f, partial=True)`` and ``smp.load``.

``partial=True`` writes this rank's file ``{f}_{pp_rank}_{tp_rank}``. Every tensor in ``obj``
that is a shard of a live DTensor (``model.local_state_dict()``, ``optimizer.local_state_dict()``
return views of them) or a DTensor itself is stored as a record with its global shape and
placement, so ``smp.load`` at another TP degree reassembles the global tensor from the saved
ranks' files, which ``DistributedModel.load_state_dict`` / ``DistributedOptimizer.load_state_dict``
then slice for the new layout. At the same layout ``smp.load`` returns the local shards as saved
(the ``same_partition_load=True`` fast path). Neither call is a collective: as in SageMaker,
callers typically save from ``smp.rdp_rank() == 0`` only.

Records are plain dicts of tensors and numbers, so files load with ``weights_only=True``, the
default of ``smp.load``: no code in a file runs. ``defaultdict``s of built-in factories are
stored as tagged dicts and come back as ``defaultdict``s (``plain.to_plain``), and so do numpy
values and Hugging Face configs.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ... import runtime
from ...tp.layout import assemble
from ..format.plain import to_plain
from ..safety import commit
from ..safety.files import read_path
from ..safety.safe_load import rebuild, torch_load

RECORD = "__modelparallel_shard__"


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _live_shards() -> dict[tuple, DTensor]:
    """Local tensors of every DTensor this job holds (model entries, optimizer states), by storage."""
    rt = runtime.current()
    found = [t for m in rt.models for t in m.module.state_dict(keep_vars=True).values()]
    found += [v for o in rt.optimizers for slots in o.optimizer.state.values() for v in slots.values()]
    found += [m for o in rt.optimizers for _, m in o.master_weights.pairs]  # fp32 masters
    return {_key(t.to_local()): t for t in found if isinstance(t, DTensor)}


def _record(local: torch.Tensor, like: DTensor) -> dict:
    placement = like.placements[0]
    if len(like.placements) != 1 or not isinstance(placement, (Shard, Replicate)):
        raise NotImplementedError(f"smp.save of a tensor placed {like.placements} (only 1-D Shard/Replicate)")
    return {RECORD: 1, "local": _own_storage(local.detach()), "global_shape": list(like.shape),
            "shard_dim": placement.dim if isinstance(placement, Shard) else -1,
            "degree": like.device_mesh.size(), "coordinate": like.device_mesh.get_local_rank()}


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a copy if it views a larger storage (torch.save writes whole storages)."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _encode(obj: Any, live: dict) -> Any:
    if isinstance(obj, DTensor):
        return _record(obj.to_local(), obj)
    if isinstance(obj, torch.Tensor):
        like = live.get(_key(obj))
        return _record(obj, like) if like is not None else obj
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict and its factory)
        out.update((k, _encode(v, live)) for k, v in obj.items())
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_encode(v, live) for v in obj)
    return obj


def save(obj: Any, f: str | Path, partial: bool = True, pickle_module: Any = None, pickle_protocol: int = 2,
         v3: bool = False) -> None:
    """Write ``obj`` (SageMaker's ``smp.save``); atomically, so a crash never leaves half a file.
    The parent directory is created if needed.

    Args:
        partial: True: this rank's file ``{f}_{pp_rank}_{tp_rank}`` with shards recorded; False:
            one file ``f`` written by global rank 0 only (``obj`` holding full tensors).
        pickle_module, pickle_protocol, v3: SageMaker's arguments, accepted for compatibility;
            the file format is always the one ``smp.load`` reads with ``weights_only=True``.

    Raises:
        TypeError: ``obj`` holds something other than tensors and plain data (it could only be
            loaded by running code).
    """
    if pickle_module is not None:
        raise NotImplementedError("smp.save(pickle_module=...): files are written in the one format that "
                                  "loads without running code")
    if not partial:
        if any(True for _ in _find(obj, lambda o: isinstance(o, DTensor))):
            raise ValueError("smp.save(partial=False) needs full tensors: pass model.state_dict(), "
                             "not DTensors or local_state_dict()")
        if runtime.rank() == 0:
            _write(obj, Path(f))
        return
    _write(_encode(obj, _live_shards()), Path(f"{f}_{runtime.pp_rank()}_{runtime.tp_rank()}"))


def _write(obj: Any, path: Path) -> None:
    from ..safety.safe_load import check_loadable

    data = check_loadable(to_plain(obj), f"smp.save's object for {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    commit.write_file_atomic(path, data)


def _find(obj: Any, match: Callable[[Any], bool]) -> Iterator[Any]:
    """Every value in the nested dicts / lists / tuples of ``obj`` for which ``match`` holds
    (not looking inside a match)."""
    if match(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _find(v, match)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _find(v, match)


def _is_record(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get(RECORD) == 1


def _read(path: Path, weights_only: bool) -> Any:
    """The object in file ``path``, opened once (``read_path``: a regular file, read from its
    descriptor); every error names the file."""
    try:
        data = io.BytesIO(read_path(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such checkpoint file") from None
    return rebuild(torch_load(data, name=str(path), trusted=not weights_only), path)


def _decode(objs: list[Any], same_layout: bool) -> Any:
    """Records replaced by local shards (same layout) or by reassembled global tensors."""
    first = objs[0]
    if _is_record(first):
        if same_layout:
            return first["local"]
        pieces = sorted(objs, key=lambda r: r["coordinate"])
        if first["shard_dim"] < 0:
            return first["local"]
        return assemble([r["local"] for r in pieces], first["shard_dim"], first["global_shape"])
    if isinstance(first, dict):
        out = copy.copy(first)
        out.update((k, _decode([o[k] for o in objs], same_layout)) for k in first)
        return out
    if type(first) in (list, tuple):
        return type(first)(_decode([o[i] for o in objs], same_layout) for i in range(len(first)))
    return first


def load(f: str | Path, partial: bool = True, weights_only: bool = True, map_location: Any = None,
         pickle_module: Any = None, **pickle_load_args) -> Any:
    """Read what ``save`` wrote (SageMaker's ``smp.load``), by default with ``weights_only=True``:
    tensors and plain data only, no code from the file runs. ``weights_only=False`` unpickles
    freely (runs whatever the file names): only for files you wrote yourself. Tensors load on
    the CPU (``map_location`` and ``pickle_module`` are SageMaker's, accepted and unused).

    With ``partial=True`` at the saving layout this rank's file is returned with local shards;
    at another TP degree, every saved rank's file is read and sharded tensors come back at their
    global shapes (each rank then holds full tensors until it loads them).

    Raises:
        FileNotFoundError: naming the missing file(s).
    """
    if not partial:
        return _read(Path(f), weights_only)
    own = Path(f"{f}_{runtime.pp_rank()}_{runtime.tp_rank()}")
    try:  # opened, not checked then opened: rank 0's file only if this rank's does not exist
        first, mine = _read(own, weights_only), True
    except FileNotFoundError:
        first, mine = _read(Path(f"{f}_{runtime.pp_rank()}_0"), weights_only), False
    records = list(_find(first, _is_record))
    degree = records[0]["degree"] if records else 1
    if mine and degree == runtime.tp_size():
        return _decode([first], same_layout=True)
    objs = [_read(Path(f"{f}_{runtime.pp_rank()}_{r}"), weights_only) for r in range(degree)]
    return _decode(objs, same_layout=False)
