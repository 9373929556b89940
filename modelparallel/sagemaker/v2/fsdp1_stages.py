"""FSDP1's optimizer state dict calls on a model cut into pipeline stages (``transform`` at
``pipeline_parallel_degree`` > 1).

``FSDP.optim_state_dict(model, optimizer)`` and ``FSDP.optim_state_dict_to_load(...)`` without
``group=`` gather over the default group, the world: under pipeline parallelism the stages hold
different parameters and PyTorch fails ("some ranks are missing some of those states"). The
ranks that share this stage's parameters are exactly the FSDP group the model was wrapped over,
so for a pipelined model a call that names no group gets ``model.process_group``: the scripts'
call form works unchanged. A call naming a group, or a model that is not pipelined, is passed
through untouched.
"""

from __future__ import annotations

import inspect

from torch.distributed.fsdp import FullyShardedDataParallel

from ...pipeline.split import stage_within
from ..wrapping import wrap_once

_MARK = "_mp_v2_stage_group"
_CALLS = ("optim_state_dict", "optim_state_dict_to_load")


def install() -> None:
    """Wrap both static methods once (idempotent)."""

    def wrap(original):
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            model = bound.arguments["model"]
            if bound.arguments.get("group") is None and stage_within(model) is not None:
                bound.arguments["group"] = model.process_group
            return original(*bound.args, **bound.kwargs)

        return call

    for name in _CALLS:
        wrap_once(FullyShardedDataParallel, name, wrap, _MARK)
