"""Which tensors of a v2 state dict an asynchronous save may copy after it returns.

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

from collections.abc import Mapping

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

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
