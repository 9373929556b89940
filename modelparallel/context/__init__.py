"""Context parallelism: every sequence split across the ranks of the "cp" mesh dimension.

Each context-parallel rank holds two chunks of every sequence (``layout``: chunks r and 2C-1-r
of 2C, balanced for causal attention) and runs the whole model on them: everything but
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
from . import hf, inputs
from .attention import COMM_TYPES, Ring
from .layout import check_split, merge, positions, split
from .spec import ContextSpec

__all__ = ["COMM_TYPES", "ContextSpec", "check_comm_type", "check_model", "check_split", "merge", "parallelize",
           "positions", "split"]

_SUPPORTED_HINT = "causal decoders whose architecture record states a ContextSpec (gpt2, gptj, gpt_neo, llama, mistral, mixtral)"


def check_comm_type(comm: str) -> None:
    """Raise ``ValueError`` naming ``comm`` unless it is one of ``COMM_TYPES``."""
    if comm not in COMM_TYPES:
        raise ValueError(f"cp_comm_type={comm!r}: expected one of {COMM_TYPES}")


def _attention_modules(model: nn.Module, spec: ContextSpec) -> list[nn.Module]:
    glob = join(base_prefix(model), spec.attention)
    return [m for path, m in model.named_modules() if path and glob_match(glob, path)]


def check_model(model: nn.Module, spec: ContextSpec | None) -> None:
    """Raise, before anything is touched, unless context parallelism can run ``model``.

    Raises:
        NotImplementedError: the architecture has no ``ContextSpec`` (an encoder, whose
            bidirectional attention is not split, or a model type without one).
        ValueError: the spec's attention glob matches no module.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if spec is None:
        kind = "an encoder (bidirectional attention)" if config is not None and not getattr(
            config, "is_decoder", True) and model_type in ("bert", "roberta") else "a model"
        raise NotImplementedError(
            f"context parallelism of {type(model).__name__} (model_type {model_type!r}, {kind}) is not "
            f"implemented; it runs {_SUPPORTED_HINT}")
    if not _attention_modules(model, spec):
        raise ValueError(f"context parallelism: no module of {type(model).__name__} matches the attention "
                         f"glob {spec.attention!r} under {base_prefix(model) or 'the model'}")


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
    model.config._attn_implementation = hf.ATTENTION
    model.register_forward_pre_hook(partial(inputs.prepare, ring), with_kwargs=True, prepend=True)
