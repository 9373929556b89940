"""``DistributedModel``: wraps a Hugging Face model, shards it in place, keeps HF's interface."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from . import runtime, wrapping
from .dp import allreduce_gradients
from .model_tp import TensorParallelMethods
from .state_dict import LoadResult, full_state_dict, load_state_dict, local_state_dict
from .tp import walker

logger = logging.getLogger("modelparallel")


class DistributedModel(TensorParallelMethods, nn.Module):
    """A model sharded over the runtime's tensor-parallel mesh (SageMaker's ``smp.DistributedModel``).

    The wrapped model computes the same function as before wrapping: pretrained weights are kept,
    each rank holding its shard. Attributes the wrapper does not define (``generate``,
    ``config``...) are looked up on the wrapped model, available as ``.module``.

    Args:
        module: the model; modules marked with ``tensor_parallelism(enabled=False)`` stay whole.
            Built on the meta device it is sharded without allocating anything (load it with
            ``smp.load_hf_checkpoint``, or build it in ``smp.delay_param_initialization()`` to
            initialize each rank's shard); real on rank 0 only and meta elsewhere, each rank
            receives its shards of rank 0's weights.

    Raises:
        ValueError: if the model was already wrapped, or its plan does not fit (before any
            tensor is touched).
    """

    def __init__(self, module: nn.Module):
        if isinstance(module, DistributedModel) or module.__dict__.get("_mp_wrapped"):
            raise ValueError("DistributedModel was already applied to this model; wrap a model once")
        rt = runtime.current()
        super().__init__()
        dtype = torch.float16 if rt.config.fp16 else torch.bfloat16 if rt.config.bf16 else None
        state = wrapping.before_shard(module, rt, dtype)  # meta / rank-0-only / delayed-init models
        replicated = walker.parallelize(module, rt.tp_mesh, state.spec)
        if replicated and runtime.rank() == 0:
            logger.info("replicated on every TP rank: %s", ", ".join(replicated))
        wrapping.after_shard(module, rt, state)
        self._mp_state = state
        module._mp_wrapped = True
        self.module = module
        rt.models.append(self)
        if rt.pending_resume is not None:  # smp.resume_from_checkpoint ran before this model existed
            rt.pending_resume.on_model(self)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def forward(self, *args, **kwargs):
        wrapping.check_ready(self.module, self._mp_state)
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (scaled by the optimizer's loss scale, if any), then average
        gradients over data-parallel replicas."""
        rt = runtime.current()
        scaler = next((o.loss_scaler for o in reversed(rt.optimizers) if getattr(o, "loss_scaler", None) is not None),
                      None)
        scale = scaler.loss_scale if scaler is not None else 1.0
        (loss * scale if scale != 1.0 else loss).backward()
        if rt.config.ddp and not self._mp_state.fsdp:  # FSDP reduce-scatters gradients itself
            allreduce_gradients(self.module.parameters(), rt.group(runtime.DP_GROUP), rt.config.dp_degree)

    def state_dict(self, gather_to_rank0: bool = False, **_) -> dict[str, torch.Tensor]:
        """The full state dict at global shapes (a collective). With ``gather_to_rank0`` only rank
        0 receives it and other ranks get ``{}``."""
        wrapping.check_ready(self.module, self._mp_state)
        return full_state_dict(self.module, gather_to_rank0)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, keyed like ``state_dict()``."""
        wrapping.check_ready(self.module, self._mp_state)
        return local_state_dict(self.module)

    def load_state_dict(self, state_dict, same_partition_load: bool = False, strict: bool = True) -> LoadResult:
        """Load a full state dict (any TP degree saved it) or this rank's local one.

        ``same_partition_load=True`` takes the fast path for a local state dict saved with the
        same layout and raises if the layout differs.
        """
        return load_state_dict(self.module, state_dict, strict=strict, same_partition_load=same_partition_load)

    def local_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters held by this rank (sharded ones as DTensors holding the local shard)."""
        return self.module.parameters()

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()
