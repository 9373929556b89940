"""When ``DistributedModel`` applies the parallel dimensions to its model.

At once, in ``DistributedModel(...)``, unless the stages are placed by the user's marks
(``pipeline_parallel_degree`` > 1 with ``auto_partition`` false): SageMaker's scripts call
``smp.set_partition`` on the wrapped model's layers after ``DistributedModel``, so the model is
split, as SageMaker does, when the stages are first needed: the first ``@smp.step`` call, or
earlier anything that needs the final parameters (``DistributedOptimizer``, a state dict,
loading a checkpoint). An optimizer built from the parameters before that holds tensors the
split replaced or removed; ``remap`` finds each one's successor by name.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from . import runtime
from .activations.wrappers import lifted
from .models import architecture_for
from .models._sagemaker import offer_tree
from .parallelize import Request, parallelize
from .pipeline import Runner
from .pipeline.marks import MARK as partition_mark
from .topology import Topology

logger = logging.getLogger("modelparallel")


def deferred(topo: Topology) -> bool:
    """Whether the split waits for the user's partition marks."""
    return topo.config.pipeline_parallel_degree > 1 and not topo.config.auto_partition


def shard(model, module: nn.Module, topo: Topology) -> None:
    """Apply every parallel dimension to ``module`` (the wrapped model) and set up ``model``'s
    pipeline runner (at pipeline degree > 1). A collective."""
    cfg = topo.config
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None
    with lifted(module, marks=(partition_mark,)):  # a script's checkpoint wrappers, put back after
        done = parallelize(module, topo, Request("v1", topo.device, dtype))
    if done.replicated and dist.get_rank() == 0:
        logger.info("replicated on every TP rank: %s", ", ".join(done.replicated))
    layout = getattr(architecture_for(module), "sagemaker", None)
    if layout is not None:  # SageMaker's names (seq_layers, .attention, .output) as aliases
        offer_tree(module, layout)
    model._mp_state = done
    # at pipeline degree > 1, runs @smp.step's microbatches through this rank's stage
    model._mp_pipeline = Runner(module, topo, topo.group(runtime.PP_GROUP), model._finish_backward) \
        if hasattr(module, "_mp_stage") else None
    if model._mp_pipeline is not None and not done.pending_meta:
        model._mp_pipeline.sync_ties()


def wait_for_marks(module: nn.Module) -> dict[int, list[str]]:
    """Prepare ``module`` for a split deferred until the user's partition marks: SageMaker's
    names (``seq_layers``...) are offered now, since the scripts mark those layers before the
    split. Returns ``before_split_names``."""
    layout = getattr(architecture_for(module), "sagemaker", None)
    if layout is not None:
        offer_tree(module, layout)
    return before_split_names(module)


def before_split_names(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> its names (several for a tied one), in the model as the user built it
    (for ``remap``)."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def ensure(model) -> None:
    """Split ``model`` now if it still waits (a collective: every rank gets here at once)."""
    if model._mp_state is None:
        shard(model, model.module, model._mp_topology)


def remap(model, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``params`` (of the model before its deferred split) as the split model's parameters of the
    same names, without those now on other stages; None if none of them was the model's."""
    names = model._mp_names
    if not names or not any(id(p) in names for p in params):
        return None
    ensure(model)
    now = dict(model.module.named_parameters(remove_duplicate=False))
    out = []
    for p in params:
        if id(p) not in names:
            out.append(p)
            continue
        here = next((now[n] for n in names[id(p)] if n in now), None)  # None: on another stage
        if here is not None:
            out.append(here)
    return list(dict.fromkeys(out))


def load_hf_checkpoint(model, path, strict: bool = True):
    """``materialize.loading.load_hf_checkpoint`` for this API layer: a ``DistributedModel``
    waiting for its partition marks is split first (the load reads only its stage's tensors)."""
    from .materialize.loading import load_hf_checkpoint as load

    if hasattr(model, "_mp_partition_now"):
        model._mp_partition_now()
    return load(model, path, strict)
