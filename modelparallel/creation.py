"""SageMaker v1's model-creation contexts: ``smp.model_creation`` and
``smp.delay_param_initialization``.

A model built inside either holds no real storage: it is built on the meta device, and the
options are remembered on its modules. ``DistributedModel`` reads them, shards the model, then
gives each rank storage for its shard only and initializes it with the model's own HF init in
HF's order (``DelayedParamIniter.init_all``), so the result equals the eagerly built model for
the same seed wherever constructors draw through ``reset_parameters``. To start from pretrained
weights instead, build under ``torch.device("meta")`` (outside these contexts: nothing is then
initialized) and call ``smp.load_hf_checkpoint(model, dir)`` after ``DistributedModel``.

Every option is honoured or refused: a value that would change numerics which this library
cannot produce raises ``NotImplementedError`` naming the option; the fusion switches only choose
kernels (the same function either way), and PyTorch picks its kernels itself.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from .materialize.creation_options import CreationOptions, apply_attention, options_of, without_vocab  # noqa: F401
from .tp import marks

logger = logging.getLogger("modelparallel")

_NOT_IMPLEMENTED = {
    "use_alibi": "ALiBi is a property of the architecture (HF BLOOM/MPT use it); it cannot be added to another",
    "attention_in_fp32": "attention runs in the model's dtype",
    "fp32_residual_addition": "residual additions run in the model's dtype",
}


def _check(options: dict) -> None:
    refused = [f"{k}={v!r} ({_NOT_IMPLEMENTED[k]})" for k, v in options.items() if v]
    if refused:
        raise NotImplementedError("model_creation options not implemented: " + "; ".join(refused))


@contextlib.contextmanager
def _building(options: CreationOptions):
    """Build on the meta device (when delayed) in ``dtype``, tagging every module that
    registers a parameter with ``options``."""
    def tag(module: nn.Module, name: str, param):
        if "_mp_creation" not in module.__dict__:
            module._mp_creation = options
        return None

    old_dtype = torch.get_default_dtype()
    handle = register_module_parameter_registration_hook(tag)
    device = torch.device("meta") if options.delayed else contextlib.nullcontext()
    try:
        if options.dtype is not None:
            torch.set_default_dtype(options.dtype)
        with device:
            yield
    finally:
        handle.remove()
        torch.set_default_dtype(old_dtype)


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True):
    """Build models inside on the meta device; ``DistributedModel`` initializes each rank's
    shard after sharding (SageMaker v1's CPU-memory saver, here no model memory at all)."""
    if not enabled:
        yield
        return
    with _building(CreationOptions(delayed=True)):
        yield


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, zero_init: bool | None = None, dtype: torch.dtype | None = None,
                   distribute_embedding: bool = False, use_alibi: bool = False, attention_in_fp32: bool = False,
                   fp32_residual_addition: bool = False, query_key_layer_scaling: bool = False,
                   fused_softmax: bool = True, fused_dropout: bool = False, fused_bias_gelu: bool = False,
                   flash_attention: bool | None = None, delayed_init: bool = True):
    """Create a model for ``DistributedModel`` (SageMaker v1's ``smp.model_creation``).

    Args:
        tensor_parallelism: mark the modules built here for tensor parallelism (as
            ``smp.tensor_parallelism()``); False builds them whole on every rank.
        zero_init: accepted either way: with delayed init no rank ever holds more than its
            shard, which is what ZeRO-style partitioned init provides.
        dtype: the dtype parameters are created in (``torch.set_default_dtype`` while building).
        distribute_embedding: shard the word embedding and the LM head tied to it over the
            vocabulary (SageMaker's default False keeps them whole on every rank).
        flash_attention: True: PyTorch's fused ``scaled_dot_product_attention`` (HF "sdpa");
            False: HF's eager attention; None: the model's own choice.
        fused_softmax, fused_dropout, fused_bias_gelu: kernel choices that do not change the
            function computed; PyTorch chooses its kernels.
        delayed_init: build on the meta device and initialize after sharding (default True).
        query_key_layer_scaling: in float16, compute layer L's attention scores divided by L
            and multiply them back in float32 (Megatron's overflow guard); no effect in other
            dtypes, nor where HF scores in float32 already (GPT-J, GPT-Neo).
        use_alibi, attention_in_fp32, fp32_residual_addition: change the numerics of HF's
            modules; True raises ``NotImplementedError``.
    """
    _check(dict(use_alibi=use_alibi, attention_in_fp32=attention_in_fp32,
                fp32_residual_addition=fp32_residual_addition))
    if fused_softmax or fused_dropout or fused_bias_gelu:
        logger.debug("modelparallel: fused kernels are chosen by PyTorch (fused_* options need no action)")
    attn = None if flash_attention is None else ("sdpa" if flash_attention else "eager")
    options = CreationOptions(delayed=delayed_init, dtype=dtype, distribute_embedding=distribute_embedding,
                              attn_implementation=attn, query_key_layer_scaling=query_key_layer_scaling)
    with marks.tensor_parallelism(enabled=tensor_parallelism), _building(options):
        yield
