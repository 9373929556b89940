"""Tensor-parallel plans as data: module-path globs mapped to style names, plus what the walker
must rewrite per rank.

A glob is a dotted module path in which ``*`` stands for exactly one whole path segment
(``h.*.attn.c_attn``). Only whole segments are wildcards: ``w1`` stays ``w1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class SharedInput:
    """The one tensor every column-parallel layer under a module reads (q, k and v off one norm;
    gate and up). Megatron's ``f`` operator is applied to it once, on its way in, so its gradient is
    all-reduced once for all of these layers rather than once per layer (PyTorch's
    ``PrepareModuleInput`` on the parent module plays the same part). Exactly one field is set.

    Attributes:
        arg: the module's ``forward`` argument holding the tensor (positional or keyword).
        output_of: or the child module (path relative to the module) whose output it is, for
            blocks whose column-parallel layers sit in several children (GPT-J's attention and
            MLP both read ``ln_1``'s output). That output must feed only those layers.
    """

    arg: str = ""
    output_of: str = ""


@dataclass(frozen=True)
class ModulePlan:
    """How to shard one module tree (a base model, a head, or a user-registered block).

    Attributes:
        rules: module-path glob -> style name (see ``styles.STYLE_NAMES``).
        packed: glob -> number of equal chunks fused along the output dimension (q|k|v = 3);
            such modules are sharded inside each chunk.
        per_rank_attrs: glob -> attribute names holding sizes that HF code reshapes with (head
            counts, split sizes, embed dims); the walker divides each by the degree.
        optional_rules: rules that may match nothing (heads present only in some model classes).
        tied_holders: globs of parameters (``module.param``) that a module only holds, never
            computes with, tied to a parameter a rule shards (BERT's ``cls.predictions.bias``, HF's
            alias of the MLM decoder's bias). They are re-pointed to the sharded parameter instead
            of being refused as a tie split between sharded and replicated modules.
        shared_inputs: glob of a module -> the ``SharedInput`` all column-parallel layers under
            it read; those layers then skip their own ``f``.
    """

    rules: dict[str, str]
    packed: dict[str, int] = field(default_factory=dict)
    per_rank_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    optional_rules: tuple[str, ...] = ()
    tied_holders: tuple[str, ...] = ()
    shared_inputs: dict[str, SharedInput] = field(default_factory=dict)


@dataclass(frozen=True)
class ArchSpec:
    """One architecture's tensor-parallel description.

    Attributes:
        model_type: the HF ``config.model_type`` it serves.
        base: plan relative to the base model (``model.base_model``, e.g. ``GPT2Model``).
        head: plan relative to the top-level model (LM head, classifier), rules optional.
        divisible_config: config attributes the degree must divide (head counts, key/value
            heads), checked with a message naming the attribute, its value and the degree.
    """

    model_type: str
    base: ModulePlan
    head: ModulePlan = field(default_factory=lambda: ModulePlan(rules={}))
    divisible_config: tuple[str, ...] = ()


VOCAB_STYLES = ("vocab_embedding", "vocab_colwise")


def without_styles(spec: ArchSpec, styles: tuple[str, ...]) -> ArchSpec:
    """``spec`` with the rules of ``styles`` removed (those modules then stay whole)."""
    strip = lambda plan: replace(plan, rules={k: v for k, v in plan.rules.items() if v not in styles})
    return replace(spec, base=strip(spec.base), head=strip(spec.head))


def glob_match(pattern: str, path: str) -> bool:
    """True when dotted ``path`` matches ``pattern`` segment by segment (``*`` = one segment)."""
    p, s = pattern.split("."), path.split(".")
    return len(p) == len(s) and all(a == "*" or a == b for a, b in zip(p, s))


def to_glob(path: str) -> str:
    """Replace numeric path segments (layer indices) by ``*``: ``h.3.attn`` -> ``h.*.attn``."""
    return ".".join("*" if seg.isdigit() else seg for seg in path.split("."))


def join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def block_prefix(pattern: str) -> str | None:
    """The repeated-block part of a rule (``h.*.attn.c_attn`` -> ``h.*``), or None if no ``*``."""
    segs = pattern.split(".")
    if "*" not in segs:
        return None
    return ".".join(segs[: segs.index("*") + 1])


def first_match(globs, path: str) -> str | None:
    """The first glob in ``globs`` that matches ``path``."""
    return next((g for g in globs if glob_match(g, path)), None)
