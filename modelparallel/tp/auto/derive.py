"""Choosing each pair's layouts and per-rank sizes: candidates from the probe, settled by the
one-process simulation.

For a pair, every column layer's layout comes from how its output is read (``chunk_hint``), and
with fewer KV heads than ranks the key/value layers are replicated. The sizes to make per-rank
are the integer attributes the modules around the pair read during the probe whose values are
head counts or widths the split changes (query heads, KV heads, their widths, the pair's own
widths, the repeat count of grouped-query attention). Candidates change as few of them as
reproduce the row layer's output, fewest first. No candidate reproducing it: the pair is refused,
naming its modules.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from torch import nn

from ..per_rank import read
from ..replicated import heads_for_rank
from .probe import Probe
from .simulate import Candidate, Layout, simulate
from .structure import Pair, chunk_hint

MAX_TRIES = 64
"""Candidates simulated per pair before it is refused."""


@dataclass(frozen=True)
class Heads:
    """The head geometry the config states (``None`` where it states none)."""

    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    heads_attr: str = "num_attention_heads"
    kv_attr: str | None = None

    @classmethod
    def of(cls, config) -> "Heads":
        heads = getattr(config, "num_attention_heads", None)
        kv_attr = next((a for a in ("num_key_value_heads", "num_kv_heads") if type(getattr(config, a, None)) is int),
                       None)
        kv = getattr(config, kv_attr) if kv_attr else heads
        hidden = getattr(config, "hidden_size", None)
        dim = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
        return cls(heads, kv, dim, kv_attr=kv_attr)

    def grouped(self) -> bool:
        return bool(self.heads and self.kv_heads and self.kv_heads < self.heads)

    def local_kv(self, tp: int) -> int:
        if self.kv_heads % tp == 0:
            return self.kv_heads // tp
        return len(heads_for_rank(self.heads, self.kv_heads, tp, 0)[0])

    def groups(self, tp: int) -> int:
        if self.kv_heads % tp == 0:
            return self.heads // self.kv_heads
        return heads_for_rank(self.heads, self.kv_heads, tp, 0)[1]


def _width(probe: Probe, path: str, out: bool) -> int:
    """A linear layer's output (or input) width: ``nn.Linear`` stores [out, in], ``Conv1D`` [in, out]."""
    module = probe.module(path)
    linear = isinstance(module, nn.Linear)
    return module.weight.shape[0 if linear == out else 1]


def layouts(probe: Probe, pair: Pair, heads: Heads, tp: int) -> dict[str, Layout] | str:
    """Each column layer's layout, or why none fits (naming the layer)."""
    out = {}
    replicate = heads.grouped() and heads.kv_heads % tp != 0
    for c in pair.columns:
        chunks = chunk_hint(probe, c)
        if chunks == 0:
            return f"{c}: its output is cut into chunks of unequal sizes, which a packed layout cannot shard"
        width = _width(probe, c, out=True)
        is_kv = replicate and chunks == 1 and heads.head_dim and width == heads.kv_heads * heads.head_dim
        out[c] = Layout(kv=(heads.heads, heads.kv_heads)) if is_kv else Layout(chunks=chunks)
    if replicate and sum(l.kv is not None for l in out.values()) not in (0, 2):
        return f"{pair.lca}: KV heads to replicate, but not exactly one key and one value projection"
    if replicate and not any(l.kv for l in out.values()) and len(pair.columns) == 1 and heads.kv_heads < heads.heads:
        return (f"{pair.columns[0]}: {heads.kv_heads} KV heads fused with the queries cannot be split over "
                f"{tp} ranks (use a degree dividing them)")
    return out


def _options(value: int, heads: Heads, tp: int, pair_widths: set[int]) -> list[int]:
    """The per-rank values a size read by the modules around a pair may take (preferred first)."""
    options = []
    if heads.grouped() and heads.heads and value == heads.heads // heads.kv_heads:
        options.append(heads.groups(tp))
    if heads.grouped() and value in (heads.kv_heads, heads.kv_heads * (heads.head_dim or 0)):
        options.append(value // heads.kv_heads * heads.local_kv(tp))
    per_head = {heads.heads, heads.heads * (heads.head_dim or 0)} if heads.heads else set()
    if value % tp == 0 and value in per_head | pair_widths | ({heads.kv_heads} if not heads.grouped() else set()):
        options.append(value // tp)
    return [o for o in dict.fromkeys(options) if o != value]


def attr_candidates(probe: Probe, pair: Pair, heads: Heads, tp: int) -> dict[tuple[str, str], list[int]]:
    """(module path, attribute) -> its per-rank values, for the sizes read around the pair."""
    widths = {_width(probe, c, out=True) for c in pair.columns} | {_width(probe, pair.row, out=False)}
    for c in pair.columns:
        chunks = chunk_hint(probe, c)
        if chunks > 1:
            widths.add(_width(probe, c, out=True) // chunks)
    out = {}
    for path in sorted(probe.reads):
        if path != pair.lca and not path.startswith(pair.lca + "."):
            continue
        for attr in sorted(probe.reads[path]):
            value = read(probe.module(path), attr)
            options = _options(value, heads, tp, widths) if type(value) is int and value > 1 else []
            if options:
                out[(path, attr)] = options
    return out


def _tries(options: dict[tuple[str, str], list[int]]):
    """Candidate attribute settings, fewest changes first: a size that matches a head count by
    coincidence (a sliding window of 4 next to 4 heads) stays as it is unless changing it is
    needed to reproduce the output."""
    keys = list(options)
    for count in range(len(keys) + 1):
        for changed in itertools.combinations(keys, count):
            for values in itertools.product(*(options[k] for k in changed)):
                yield dict(zip(changed, values))


def _fails(probes: list[Probe], pair: Pair, candidate: Candidate, tp: int) -> str | None:
    """Why ``candidate`` does not reproduce the row layer's output under one of the probes'
    attention implementations, or None."""
    for probe in probes:
        try:
            worst, allowed = simulate(probe, pair.lca, pair.row, candidate, tp)
        except Exception as e:  # noqa: BLE001 - a candidate that does not even run is a wrong one
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if not worst <= allowed:
            return f"off by {worst:.3g} (rounding allows {allowed:.3g}) with {probe.attention} attention"
    return None


def choose(probes: list[Probe], pair: Pair, heads: Heads, tp: int) -> Candidate | str:
    """The first candidate reproducing the row layer's output under every probe (the model's
    attention implementation and eager, which reshapes with the module's own sizes), or why none
    does."""
    probe = probes[0]
    found = layouts(probe, pair, heads, tp)
    if isinstance(found, str):
        return found
    options = attr_candidates(probe, pair, heads, tp)
    last = "no candidate"
    for attrs in itertools.islice(_tries(options), MAX_TRIES):
        candidate = Candidate(found, attrs)
        last = _fails(probes, pair, candidate, tp)
        if last is None:
            return candidate
    tried = ", ".join(f"{p}.{a}" for p, a in options) or "none"
    return (f"{pair.lca}: no split of {', '.join(pair.columns)} -> {pair.row} over {tp} ranks reproduces its "
            f"output ({last}; per-rank sizes tried: {tried})")
