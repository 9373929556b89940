"""The automatic plan of a Hugging Face model with no file in ``modelparallel/models``: found on a
proxy in one process, returned as the same plan data a model file holds (an ``ArchSpec``).

Steps: refuse inputs no plan can serve (head counts the degree does not divide, an embedding
whose first dimension is not the vocabulary, an attention implementation not known to compute
head by head) -> build the proxy -> one recorded forward -> blocks and Megatron pairs from the
autograd graph -> each pair's layouts and per-rank sizes, settled by simulating the split in one
process -> the same choice in every block -> the plan: column/row rules with packed chunks,
per-rank sizes, shared inputs (one ``f`` for the column layers reading one tensor), KV-head
replication rules, vocabulary-parallel embedding and LM head. Anything it cannot place is
refused with ``AutoPlanError`` naming the module.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layout import base_prefix, tied_parameters
from ..model_checks import attention_problems
from ..plan import ArchSpec, KVHeads, ModulePlan, Packed, SharedInput, glob_match, to_glob
from .derive import Heads, choose
from .probe import LINEAR, run_probe, set_attention
from .proxy import build_proxy, on_cpu, probe_ids
from .simulate import Candidate
from .structure import Pair, block_of, find_blocks, find_pairs, linears, shared_inputs

class AutoPlanError(ValueError):
    """The automatic plan cannot shard this model; the message names the module at fault."""


def check_inputs(model: nn.Module, tp: int) -> None:
    """Refuse, naming the module or config entry, what no plan can serve."""
    config, name = model.config, type(model).__name__
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads % tp:
        raise AutoPlanError(f"{type(config).__name__}.num_attention_heads = {heads} is not divisible by "
                            f"tensor_parallel_degree {tp} (each rank must hold whole heads)")
    for problem in attention_problems(model):
        raise AutoPlanError(problem)
    emb, vocab = model.get_input_embeddings(), getattr(config, "vocab_size", None)
    path = next((p for p, m in model.named_modules() if m is emb), "?")
    if not isinstance(emb, nn.Embedding):
        raise AutoPlanError(f"{name}.{path}: the input embedding is a {type(emb).__name__}, not an nn.Embedding")
    if emb.weight.shape[0] != vocab:
        raise AutoPlanError(f"{name}.{path}: its first dimension ({emb.weight.shape[0]}) is not the vocabulary "
                            f"({type(config).__name__}.vocab_size = {vocab}); its weight is {tuple(emb.weight.shape)}")


def check_class_builds_it(model: nn.Module) -> None:
    """Refuse a model whose modules differ from what its class builds from its config (modules
    replaced or resized afterwards): the plan is found on a proxy of the class, so it would not
    describe this model. Built on the meta device: nothing is allocated."""
    import copy

    import torch

    with torch.device("meta"):
        built = type(model)(copy.deepcopy(model.config))
    expected = dict(built.named_modules())
    for path, module in model.named_modules():
        other = expected.get(path)
        if other is None or type(other) is not type(module) or _shape(other) != _shape(module):
            raise AutoPlanError(f"{path}: {_describe(module)}, where {type(model).__name__}(config) builds "
                                f"{_describe(other)}: the automatic plan is found on the model its class builds "
                                "(write a model file, or register a plan for the changed modules)")


def _shape(module) -> tuple:
    weight = getattr(module, "weight", None)
    return tuple(weight.shape) if weight is not None else ()


def _describe(module) -> str:
    if module is None:
        return "nothing"
    return type(module).__name__ + (f" {_shape(module)}" if _shape(module) else "")


@dataclass
class Found:
    """What the derivation settled, for the plan and for printing it."""

    spec: ArchSpec
    pairs: list[Pair]
    choices: dict[str, Candidate]  # row path -> candidate


def _glob(path: str, prefix: str) -> str:
    return to_glob(path[len(prefix) + 1:] if prefix and path.startswith(prefix + ".") else path)


def _relative(choice: Candidate, pair: Pair) -> tuple:
    """A pair's choice with block indices replaced by ``*``: equal for every block of one kind."""
    return (tuple(sorted((to_glob(c), l) for c, l in choice.layouts.items())),
            tuple(sorted(((to_glob(p), a), v) for (p, a), v in choice.attrs.items())))


@on_cpu
def derive(model: nn.Module, tp: int) -> Found:
    """The automatic plan of ``model`` at degree ``tp`` (one process, no communication).

    Raises:
        AutoPlanError: naming the module or config entry the plan cannot serve.
    """
    check_inputs(model, tp)
    check_class_builds_it(model)
    proxy = build_proxy(model)
    blocks = find_blocks(proxy)
    if not blocks:
        raise AutoPlanError(f"{type(model).__name__}: no repeated blocks (an nn.ModuleList of one layer class "
                            "holding linear layers) to shard")
    watched = [p for p, m in proxy.named_modules() if block_of(p, blocks) and not isinstance(m, LINEAR)]
    ids = probe_ids(proxy.config)
    probes = [run_probe(proxy, ids, watched, name)
              for name in dict.fromkeys([getattr(proxy.config, "_attn_implementation", None), "eager"])]
    probe = probes[0]
    called = linears(proxy, probe)
    twice = [p for p in called if block_of(p, blocks) and probe.counts[p] > 1]
    if twice:
        raise AutoPlanError(f"{to_glob(twice[0])}: called {probe.counts[twice[0]]} times in one forward; the automatic "
                            "plan shards layers called once")
    pairs, unplaced, consumers = find_pairs(probe, blocks, called)
    if unplaced:
        p = unplaced[0]
        raise AutoPlanError(f"{to_glob(p)} ({type(proxy.get_submodule(p)).__name__}): not in a column -> row pair "
                            f"(its output is read by {sorted(map(to_glob, consumers[p])) or 'no linear layer'}); "
                            "the automatic plan cannot place it")
    heads, choices, kinds = Heads.of(proxy.config), {}, {}
    for pair in pairs:
        choice = choose(probes, pair, heads, tp)
        if isinstance(choice, str):
            raise AutoPlanError(choice)
        choices[pair.row] = choice
        kind = to_glob(pair.row)
        if kinds.setdefault(kind, _relative(choice, pair)) != _relative(choice, pair):
            raise AutoPlanError(f"{pair.block}: its {to_glob(pair.lca)} needs another split than the same module "
                                "of an earlier block")
    kv = _kv_rules(probes, pairs, heads, choices, tp)
    set_attention(proxy, probe.attention)
    spec = assemble(model, proxy, probe, pairs, choices, heads, kv)
    return Found(spec, pairs, choices)


def _degree(heads: Heads, replicating: bool) -> int | None:
    """The smallest degree that splits the query heads and replicates (or splits) the KV heads."""
    return next((t for t in range(2, heads.heads + 1)
                 if heads.heads % t == 0 and bool(heads.kv_heads % t) == replicating), None)


def _changed(probes, pair: Pair, heads: Heads, degree: int | None, choices: dict, tp: int) -> dict[str, int]:
    """The attributes of ``pair``'s enclosing module its choice at ``degree`` changes."""
    if degree is None:
        return {}
    choice = choose(probes, pair, heads, degree) if degree != tp else choices[pair.row]
    if isinstance(choice, str):
        raise AutoPlanError(f"{choice} (at degree {degree}, to settle its KV-head rule)")
    return {a: v for (p, a), v in choice.attrs.items() if p == pair.lca}


def _kv_rules(probes, pairs: list[Pair], heads: Heads, choices: dict, tp: int) -> dict[str, KVHeads]:
    """Attention module glob -> ``KVHeads`` for grouped-query attention with separate k/v layers.

    Which attributes hold the KV head count and which the repeat count is read from two
    simulated degrees, whatever the degree the plan is derived at: one splitting the KV heads
    (what changes there to ``kv_heads / degree`` is a count) and one replicating them (what then
    changes besides the counts is the repeat count); their values alone can coincide (2 KV heads
    repeated twice)."""
    if not heads.grouped():
        return {}
    probe, out = probes[0], {}
    for pair in pairs:
        width = heads.kv_heads * (heads.head_dim or 0)
        kv = [c for c in pair.columns if probe.module(c).weight.shape[0] == width and len(pair.columns) > 2]
        if len(kv) != 2:
            continue
        split = _changed(probes, pair, heads, _degree(heads, False), choices, tp)
        counts = tuple(a for a in split if probe.module(pair.lca).__dict__.get(a) == heads.kv_heads)
        repl = _changed(probes, pair, heads, _degree(heads, True), choices, tp)
        group_attr = next((a for a in repl if a not in counts
                           and probe.module(pair.lca).__dict__.get(a) == heads.heads // heads.kv_heads), "")
        out[to_glob(pair.lca)] = KVHeads(kv=tuple(c[len(pair.lca) + 1:] for c in kv), heads=heads.heads_attr,
                                         kv_heads=heads.kv_attr, groups=group_attr, counts=counts)
    return out


def assemble(model, proxy, probe, pairs: list[Pair], choices: dict, heads: Heads, kv: dict) -> ArchSpec:
    """The plan data of the choices: rules and the rest relative to the base model, the LM head
    relative to the model."""
    prefix = base_prefix(proxy)
    rules, packed, per_rank = {}, {}, {}
    kv_attrs = {(glob, a) for glob, k in kv.items() for a in (k.groups, *k.counts) if a}
    for pair in pairs:
        choice = choices[pair.row]
        for c, layout in choice.layouts.items():
            glob = _glob(c, prefix)
            rules[glob] = "packed_colwise" if layout.chunks > 1 else "colwise"
            if layout.chunks > 1:
                conv = not isinstance(probe.module(c), nn.Linear)
                packed[glob] = Packed(layout.chunks, {"weight": 1 if conv else 0, "bias": 0})
        rules[_glob(pair.row, prefix)] = "rowwise"
        for module in pair.replicated:  # whole on every rank, applied to its heads: gradients summed
            rules[_glob(module, prefix)] = "replicated_grad_sum"
        for (path, attr), _ in choice.attrs.items():
            if (to_glob(path), attr) not in kv_attrs:
                per_rank.setdefault(_glob(path, prefix), [])
                if attr not in per_rank[_glob(path, prefix)]:
                    per_rank[_glob(path, prefix)].append(attr)
    emb = proxy.get_input_embeddings()
    rules[_glob(next(p for p, m in proxy.named_modules() if m is emb), prefix)] = "vocab_embedding"
    shared = {_glob(p, prefix): SharedInput(**{kind: value})
              for p, (kind, value) in shared_inputs(probe, pairs).items()}
    base = ModulePlan(rules=rules, packed=packed, per_rank_attrs={k: tuple(v) for k, v in per_rank.items()},
                      shared_inputs=shared, kv_heads={_glob(k, prefix): v for k, v in kv.items()})
    return ArchSpec(model_type=model.config.model_type, base=base, head=_head(proxy, prefix, rules),
                    divisible_config=("num_attention_heads",) if heads.heads else (),
                    loss="masked" if "MaskedLM" in type(model).__name__ else "causal",
                    sequence_parallel=False)  # under it: auto.with_sequence_parallel


def _head(proxy, prefix: str, base_rules: dict[str, str]) -> ModulePlan:
    """The LM head's rule, and the parameters that only hold a tie to a sharded one (BERT's
    ``cls.predictions.bias``, the MLM decoder's bias under another name)."""
    head = proxy.get_output_embeddings() if hasattr(proxy, "get_output_embeddings") else None
    if head is None:
        return ModulePlan(rules={})
    path = next(p for p, m in proxy.named_modules() if m is head)
    if not isinstance(head, nn.Linear) or head.out_features != proxy.config.vocab_size:
        raise AutoPlanError(f"{path} ({type(head).__name__}): the output embedding is not an nn.Linear over the "
                            "vocabulary")
    ruled = {f"{prefix}.{g}" if prefix else g for g in base_rules} | {path}
    holders = []
    for group in tied_parameters(proxy):
        styled = [any(glob_match(g, to_glob(mpath)) for g in ruled) for mpath, _, _ in group]
        if any(styled):
            holders += [f"{to_glob(mpath)}.{name}" for (mpath, _, name), s in zip(group, styled) if not s]
    return ModulePlan(rules={path: "vocab_colwise"}, optional_rules=(path,), tied_holders=tuple(sorted(set(holders))))
