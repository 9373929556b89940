"""Transformers' own plans read as ours: the first candidate for a model with no architecture record.

Transformers 5 puts a tensor-parallel plan on many config classes (``LlamaConfig.base_model_tp_plan``:
module glob -> style name, relative to the base model) and a pipeline plan next to it
(``base_model_pp_plan``: the base model's top-level modules in running order, each with its input
and output names; ``pipeline.split.hf_pipeline_split`` reads that one). Where HF's plan uses
only styles that mean what ours mean, it is our plan with two additions we always make: the
embedding and the LM head sharded over the vocabulary (HF keeps the embedding whole in the base
plan and gathers the LM head's logits). A candidate is verified over the TP ranks like a derived
plan; one that does not reproduce the model is dropped for the derivation.
"""

from __future__ import annotations

import inspect
from collections import Counter

from torch import nn

from ..layout import base_prefix
from ..plan import ArchSpec, ModulePlan, SharedInput, glob_match, to_glob
from ..walker import collect
from .plan import _head

HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "replicated_grad_sum"}
"""HF style name -> ours, for the styles that shard (or keep) a module the same way: a column
layer's output split over the ranks, a row layer's input split and its output summed, a module
kept whole whose gradient is summed over the ranks. HF's others gather or split activations
between layers (``colwise_gather_output``), shard experts (``moe_tp_experts``) or pack chunks
of a size ours reads from the plan (``packed_colwise``): a plan using one is no candidate."""


def hf_tp_rules(config) -> dict[str, str]:
    """HF's ``base_model_tp_plan`` of a config (instance or class), {} if it has none."""
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def candidate(model: nn.Module, tp: int) -> ArchSpec | None:
    """HF's plan of ``model`` as an ``ArchSpec``, or None where it has none, uses a style ours
    does not mean the same way (see ``HF_STYLES``) or does not fit the model at degree ``tp``
    (the walker's checks: a rule matching nothing, a linear layer of a block no rule covers, a
    size the degree does not divide; a model whose modules were replaced after it was built)."""
    plan = hf_tp_rules(model.config)
    if not plan or any(style not in HF_STYLES for style in plan.values()):
        return None
    prefix = base_prefix(model)
    emb = model.get_input_embeddings()
    path = next(p for p, m in model.named_modules() if m is emb)
    rules = {to_glob(path[len(prefix) + 1:] if prefix else path): "vocab_embedding",
             **{glob: HF_STYLES[style] for glob, style in plan.items()}}
    heads = getattr(model.config, "num_attention_heads", None)
    base = ModulePlan(rules=rules, shared_inputs=_shared_inputs(model.base_model, rules))
    spec = ArchSpec(model_type=model.config.model_type, base=base, head=_head(model, prefix, rules),
                    divisible_config=("num_attention_heads",) if heads else (),
                    loss="masked" if "MaskedLM" in type(model).__name__ else "causal",
                    sequence_parallel=False)  # under it: auto.with_sequence_parallel
    return None if collect(model, spec, tp).problems else spec


def gathering_inputs(model: nn.Module, spec: ArchSpec) -> dict[str, SharedInput]:
    """``spec``'s shared inputs plus one at every module holding a column layer (its first
    argument): under sequence parallelism the sequence is then gathered where such a module is
    entered, for one that reads its input's [batch, seq] (a fused qkv's reshape). A wrong guess
    computes other gradients, which the verification catches."""
    return {**_shared_inputs(model.base_model, spec.base.rules, least=1), **spec.base.shared_inputs}


def _shared_inputs(base: nn.Module, rules: dict[str, str], least: int = 2) -> dict[str, SharedInput]:
    """A guess of the one tensor several column layers read (q, k, v; gate, up): the first
    argument of the module holding at least ``least`` of them. It saves one input all-reduce per
    extra layer; a wrong guess computes other gradients, which the verification catches (then the
    plan is tried without it)."""
    columns = ("colwise", "packed_colwise")
    parents = Counter(g.rsplit(".", 1)[0] for g, s in rules.items() if s in columns and "." in g)
    out = {}
    for glob in (g for g, n in parents.items() if n >= least):
        module = next((m for p, m in base.named_modules() if glob_match(glob, p)), None)
        params = list(inspect.signature(module.forward).parameters) if module is not None else []
        if params:
            out[glob] = SharedInput(arg=params[0])
    return out
