"""FSDP1's ``offload_to_cpu`` state dicts on a CPU job.

SageMaker v2 scripts export the whole model with ``FSDP.state_dict_type(model, FULL_STATE_DICT,
FullStateDictConfig(rank0_only=True, offload_to_cpu=True))``. PyTorch's FSDP1 serves
``offload_to_cpu`` by moving the gathered flat parameter to the CPU and freeing the gathered copy
on the compute device; when the compute device *is* the CPU the move returns the same tensor, so
the free releases the memory the state dict is then read from (rank 0 dies of a segmentation
fault in ``state_dict()``, with or without this library). On a CPU handle the tensors already are
where ``offload_to_cpu`` asks them to be, so its move is skipped; on GPUs nothing changes.
"""

from __future__ import annotations

import contextlib

from ...compat import FlatParamHandle
from ..wrapping import wrap_once

_MARK = "_mp_cpu_offload"


def install() -> None:
    """Wrap ``FlatParamHandle.to_cpu`` (idempotent): a no-op for a flat parameter on the CPU."""

    def wrap(original):
        def to_cpu(self):
            return contextlib.nullcontext() if self.flat_param.device.type == "cpu" else original(self)
        return to_cpu

    wrap_once(FlatParamHandle, "to_cpu", wrap, _MARK)
