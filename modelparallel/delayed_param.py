"""``smp.delayed_param.DelayedParamIniter``: initialize a meta-device model after sharding.

SageMaker v2's API, a thin layer over ``materialize/init_engine.py``. A model built on the meta
device is sharded first (each rank then describes only its shard); the initer then gives each
module's tensors storage and runs the model's own initialization on them, module by module, as
FSDP's ``param_init_fn`` expects (one module, not its children).

Three named steps and a guard: ``get_param_init_fn`` (materialize + init),
``get_post_param_init_fn`` (restore ties), ``validate_params_and_buffers_inited`` (raise naming
every tensor left on meta or never written by the init method).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from .materialize import meta
from .materialize.init_engine import InitEngine
from .materialize.rank0_sync import SYNCED_FROM_RANK0

logger = logging.getLogger("modelparallel")

__all__ = ["DelayedParamIniter"]


def _device() -> torch.device:
    from . import runtime

    return runtime.current().device if runtime.is_initialized() else torch.device("cpu")


class DelayedParamIniter(InitEngine):
    """Initialize the meta parameters and buffers of ``model`` in place, module by module.

    A model whose tensors all hold data (``transform(model, load_state_dict_from_rank0=True)``
    already gave every rank its shards of rank 0's weights) has nothing to initialize: the initer
    is then a no-op (``noop`` is True), its init functions leave every tensor as it is and the
    guard passes, so the FSDP wrapping written for SageMaker (``param_init_fn`` on ranks != 0,
    ``sync_module_states``) runs unchanged and nothing is initialized twice.

    Args:
        model: a model built on the meta device (``torch.device("meta")`` or
            ``accelerate.init_empty_weights()``), sharded or not; tensors already holding data
            are left untouched.
        init_method_using_config: ``fn(module)`` initializing one module's own parameters and
            buffers. Default: the HF model's ``_init_weights`` (which also recomputes rotary
            ``inv_freq``, position ids and causal masks), else each module's ``reset_parameters``.
        verbose: log each module as it is initialized.

    Raises:
        MetaTensorError: when ``model`` was filled from rank 0 by ``transform`` but has tensors
            on meta again, naming them.
    """

    def __init__(self, model: nn.Module, init_method_using_config: Callable[[nn.Module], None] | None = None,
                 verbose: bool = False):
        left = meta.meta_names(model)
        if left and model.__dict__.get(SYNCED_FROM_RANK0):
            raise meta.MetaTensorError(
                f"DelayedParamIniter: this {type(model).__name__} was filled from rank 0 by "
                "transform(load_state_dict_from_rank0=True), yet these tensors are on the meta device "
                f"(added or replaced since?): {', '.join(left)}")
        self.noop = not left
        if self.noop:
            logger.info("modelparallel: DelayedParamIniter of a %s whose tensors all hold data (filled by "
                        "transform(load_state_dict_from_rank0=True) or built for real): nothing to "
                        "initialize, its init functions leave the data as it is", type(model).__name__)
        super().__init__(model, init_method_using_config, verbose, _device())
