"""Tensor-parallel plans as data: module-path globs mapped to style names, plus what the walker
must rewrite per rank.

A glob is a dotted module path in which ``*`` stands for exactly one whole path segment
(``h.*.attn.c_attn``). Only whole segments are wildcards: ``w1`` stays ``w1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

LOSS_KINDS = ("causal", "masked")
"""LM losses on vocabulary-sharded logits: next-token prediction, or labels aligned with positions."""


@dataclass(frozen=True)
class Packed:
    """One fused weight: ``chunks`` equal outputs (q|k|v = 3) concatenated in HF's tensors.

    The one statement of a fused layout: the plan shards inside each chunk from it, the key table
    derives its (dim, chunks) entries from it (``packed_keys``) and the shard-on-read loader reads
    it back from the module the style sharded.

    Attributes:
        chunks: how many equal parts the fused output holds.
        dims: parameter name -> the dimension of HF's tensor that concatenates the chunks (1 for a
            ``Conv1D`` weight [in, out], 0 for an ``nn.Linear`` weight [out, in] and for biases).
            The distributed format splits it in two, [..., chunks, size / chunks, ...]. ``None``
            (a plan that gives only a count): the output dimension of the module's type.
    """

    chunks: int
    dims: dict[str, int] | None = None


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
class KVHeads:
    """Grouped-query attention under a module: its key/value projections hold ``kv_heads`` heads
    for ``heads`` query heads (config attribute names). When the degree divides the KV heads the
    rules' column parallelism gives each rank whole KV heads; otherwise each rank computes the KV
    heads its query heads read from a replicated weight (``replicated.KVReplicated``) and the
    module's ``groups`` attribute (query heads per KV head) becomes the rank's.

    Attributes:
        kv: the key and value projections, relative to the module.
        heads, kv_heads: the config attributes holding the query and KV head counts.
        groups: the module attribute HF repeats each KV head by ("" if none).
        counts: module attributes holding the KV head count, set to the rank's.
    """

    kv: tuple[str, ...] = ("k_proj", "v_proj")
    heads: str = "num_attention_heads"
    kv_heads: str = "num_key_value_heads"
    groups: str = "num_key_value_groups"
    counts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModulePlan:
    """How to shard one module tree (a base model, a head, or a user-registered block).

    Attributes:
        rules: module-path glob -> style name (see ``styles.STYLE_NAMES``).
        packed: glob -> ``Packed`` descriptor, or just the number of equal chunks fused along the
            output dimension (q|k|v = 3); such modules are sharded inside each chunk.
        per_rank_attrs: glob -> attribute names holding sizes that HF code reshapes with (head
            counts, split sizes, embed dims); the walker divides each by the degree. A dotted name
            (``config.num_attention_heads``) is read from an object the module holds and divided
            in the module's own view of it (``per_rank.ConfigView``).
        optional_rules: rules that may match nothing (heads present only in some model classes).
        tied_holders: globs of parameters (``module.param``) that a module only holds, never
            computes with, tied to a parameter a rule shards (BERT's ``cls.predictions.bias``, HF's
            alias of the MLM decoder's bias). They are re-pointed to the sharded parameter instead
            of being refused as a tie split between sharded and replicated modules.
        shared_inputs: glob of a module -> the ``SharedInput`` all column-parallel layers under
            it read; those layers then skip their own ``f``.
        kv_heads: glob of an attention module -> its ``KVHeads`` (grouped-query attention whose
            KV heads are replicated when the degree does not divide them).
        replicated: globs of linear layers inside a planned block that stay whole on every rank
            on purpose (an output too narrow to split, such as a scalar gate), exempt from the
            walker's "no rule covers it" refusal.
    """

    rules: dict[str, str]
    packed: dict[str, Packed | int] = field(default_factory=dict)
    per_rank_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    optional_rules: tuple[str, ...] = ()
    tied_holders: tuple[str, ...] = ()
    shared_inputs: dict[str, SharedInput] = field(default_factory=dict)
    kv_heads: dict[str, KVHeads] = field(default_factory=dict)
    replicated: tuple[str, ...] = ()


@dataclass(frozen=True)
class Unsupported:
    """A configuration of an architecture its plan cannot shard (Falcon's ALiBi biases, built for
    all heads at once): refused with ``NotImplementedError`` naming ``what``.

    Attributes:
        what: the feature, as the error names it.
        when: config attribute -> value; the case applies when every one has that value...
        differ: ...and, if given, these config attributes do not all have the same value.
    """

    what: str
    when: dict[str, object] = field(default_factory=dict)
    differ: tuple[str, ...] = ()

    def applies(self, config) -> bool:
        values = {getattr(config, k, None) for k in self.differ}
        return all(getattr(config, k, None) == v for k, v in self.when.items()) and len(values) != 1

    def describe(self, config) -> str:
        """The config values that make the case apply, for the error."""
        return ", ".join(f"{k}={getattr(config, k, None)!r}" for k in (*self.when, *self.differ))


@dataclass(frozen=True)
class ArchSpec:
    """One architecture's tensor-parallel description.

    Attributes:
        model_type: the HF ``config.model_type`` it serves.
        base: plan relative to the base model (``model.base_model``, e.g. ``GPT2Model``).
        head: plan relative to the top-level model (LM head, classifier), rules optional.
        divisible_config: config attributes the degree must divide (head counts, key/value
            heads), checked with a message naming the attribute, its value and the degree.
        loss: the LM loss of its heads, one of ``LOSS_KINDS``, computed on vocab-sharded logits.
        head_losses: head class name -> loss kind, for heads whose loss differs from ``loss``
            (BERT's ``BertLMHeadModel`` is causal where ``BertForMaskedLM`` is masked).
        unsupported: configurations refused with ``NotImplementedError`` (see ``Unsupported``).
        sequence_parallel: whether the plan is known to reproduce the model under sequence
            parallelism (tested against one process); False: ``sequence_parallel`` is refused
            with ``NotImplementedError`` rather than run unchecked.
        sequence_unsupported: configurations refused under sequence parallelism only.
    """

    model_type: str
    base: ModulePlan
    head: ModulePlan = field(default_factory=lambda: ModulePlan(rules={}))
    divisible_config: tuple[str, ...] = ()
    loss: str = "causal"
    head_losses: dict[str, str] = field(default_factory=dict)
    unsupported: tuple[Unsupported, ...] = ()
    sequence_parallel: bool = True
    sequence_unsupported: tuple[Unsupported, ...] = ()

    def __post_init__(self):
        for kind in (self.loss, *self.head_losses.values()):
            if kind not in LOSS_KINDS:
                raise ValueError(f"{self.model_type}: loss kind {kind!r} is not one of {LOSS_KINDS}")

    def loss_for(self, model_class: type) -> str:
        """The loss kind of a head class (or of a subclass of a listed one)."""
        return next((self.head_losses[c.__name__] for c in model_class.__mro__ if c.__name__ in self.head_losses),
                    self.loss)


VOCAB_STYLES = ("vocab_embedding", "vocab_colwise")

KNOWN_ATTENTION = ("eager", "sdpa", "flex_attention")
"""Attention implementations that compute each head on its own (also any ``flash_attention_*``
and ``paged|...`` of these): on a rank's heads they give that rank's part of the result. A
function registered under another name may read global head counts: refused."""


QK_SCALING_PREFIX = "modelparallel_qk_layer_scaling_"
"""Our ``query_key_layer_scaling`` implementations (materialize/qk_scaling.py) are named this plus
the known implementation they wrap, which they call head by head as it is."""


def known_attention(name) -> bool:
    """Whether HF attention implementation ``name`` (a config's ``_attn_implementation``) is one
    of ``KNOWN_ATTENTION`` (or our query-key scaling around one)."""
    base = str(name).split("|")[-1].removeprefix(QK_SCALING_PREFIX)
    return name is None or base in KNOWN_ATTENTION or base.startswith("flash_attention")


def without_styles(spec: ArchSpec, styles: tuple[str, ...]) -> ArchSpec:
    """``spec`` with the rules of ``styles`` removed (those modules then stay whole)."""
    strip = lambda plan: replace(plan, rules={k: v for k, v in plan.rules.items() if v not in styles})
    return replace(spec, base=strip(spec.base), head=strip(spec.head))


def packing(plan: ModulePlan, path: str) -> Packed | None:
    """The ``Packed`` descriptor of module ``path`` in ``plan`` (a bare count made one), or None."""
    glob = first_match(plan.packed, path)
    if glob is None:
        return None
    entry = plan.packed[glob]
    return entry if isinstance(entry, Packed) else Packed(entry)


def packed_keys(packed: dict[str, Packed]) -> dict[str, tuple[int, int]]:
    """State-dict key templates (``{}`` = layer index) -> (dim, chunks), from module globs -> ``Packed``."""
    return {f"{glob.replace('*', '{}')}.{name}": (dim, p.chunks)
            for glob, p in packed.items() for name, dim in (p.dims or {}).items()}


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
