"""Context parallelism: every sequence split across the ranks of the "cp" mesh dimension.

Each context-parallel rank holds two chunks of every sequence (``layout``: chunks r and 2C-1-r
of 2C, balanced for causal attention; encoders keep the same split, so one batch helper serves
both) and runs the whole model on them: everything but
attention is per token, and attention (``attention``) brings the other ranks' keys and values to
this rank's queries, by ring or all-gather. ``parallelize`` sets up an HF model for it: its
self-attention modules (``hf``), and its inputs (``inputs``: global positions, shifted labels,
each rank's share of the loss). Parameters are not split: the context-parallel ranks hold the
same weights, and their gradients are averaged over the data x context ranks by the caller's
data parallelism.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..tp.layout import base_prefix
from ..tp.plan import glob_match, join
from . import decode, hf, inputs
from .attention import COMM_TYPES, Ring
from .layout import check_split, merge, positions, split
from .spec import ContextSpec

__all__ = ["COMM_TYPES", "ContextSpec", "check_comm_type", "check_model", "check_split", "merge", "parallelize",
           "positions", "split"]

_SUPPORTED_HINT = ("models whose architecture record states a ContextSpec (decoders gpt2, gptj, gpt_neo, llama, "
                   "mistral, mixtral; encoders bert, roberta)")


def check_comm_type(comm: str) -> None:
    """Raise ``ValueError`` naming ``comm`` unless it is one of ``COMM_TYPES``."""
    if comm not in COMM_TYPES:
        raise ValueError(f"cp_comm_type={comm!r}: expected one of {COMM_TYPES}")


def _attention_modules(model: nn.Module, spec: ContextSpec) -> list[nn.Module]:
    glob = join(base_prefix(model), spec.attention)
    return [m for path, m in model.named_modules() if path and glob_match(glob, path)]


def _causal(model: nn.Module, modules: list[nn.Module]) -> bool:
    """Whether ``model``'s self-attention is causal (its modules' ``is_causal``; decoders' method
    adapters are); one answer for every module, or ``NotImplementedError``."""
    kinds = {bool(getattr(m, "is_causal", True)) for m in modules}
    if len(kinds) > 1:
        raise NotImplementedError(f"context parallelism of {type(model).__name__}: causal and bidirectional "
                                  "self-attention in one model is not implemented")
    return kinds.pop()


def check_model(model: nn.Module, spec: ContextSpec | None) -> None:
    """Raise, before anything is touched, unless context parallelism can run ``model``.

    Raises:
        NotImplementedError: the architecture has no ``ContextSpec``, the spec does not list this
            head class, or the model has cross-attention.
        ValueError: the spec's attention glob matches no module.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    if spec is None:
        raise NotImplementedError(f"context parallelism of {name} (model_type {model_type!r}) is not "
                                  f"implemented; it runs {_SUPPORTED_HINT}")
    if spec.heads is not None and name not in spec.heads:
        raise NotImplementedError(f"context parallelism of {name} is not implemented: its head needs the whole "
                                  f"sequence on one rank; for model_type {model_type!r} it runs {spec.heads}")
    if getattr(config, "add_cross_attention", False):
        raise NotImplementedError(f"context parallelism of {name} with cross-attention is not implemented")
    modules = _attention_modules(model, spec)
    if not modules:
        raise ValueError(f"context parallelism: no module of {name} matches the attention "
                         f"glob {spec.attention!r} under {base_prefix(model) or 'the model'}")
    _causal(model, modules)


def parallelize(model: nn.Module, cp_mesh: DeviceMesh, spec: ContextSpec | None, comm: str = "p2p") -> None:
    """Make ``model`` (an HF model, possibly tensor-parallel already) run on this rank's part of
    every sequence, with attention over the whole sequence through ``cp_mesh``, in place.

    Args:
        model: the top-level HF model (its forward receives input_ids / labels of S / C tokens).
        cp_mesh: the 1-D context-parallel mesh.
        spec: the architecture's ``ContextSpec``.
        comm: "p2p" (ring) or "all_gather".

    Raises:
        ValueError, NotImplementedError: see ``check_comm_type`` and ``check_model``; raised
            before the model is changed.
    """
    check_comm_type(comm)
    check_model(model, spec)
    ring = Ring(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size(), comm)
    hf.register()
    for module in _attention_modules(model, spec):
        hf.install(module, ring, spec)
    causal = _causal(model, _attention_modules(model, spec))
    model.config._attn_implementation = hf.ATTENTION
    model.register_forward_pre_hook(partial(inputs.prepare, ring, spec, causal), with_kwargs=True, prepend=True)
    if not causal:
        model.register_forward_hook(inputs.token_loss, with_kwargs=True)
    model.register_forward_hook(partial(decode.finish_prefill, ring), with_kwargs=True)
