"""Tensor parallelism of one Megatron pair, simulated in one process on the proxy.

For each rank in turn the pair's column layers get that rank's slices of their weights (laid out
as the candidate says), the modules between them their per-rank sizes, and the module enclosing
the pair is replayed on its recorded inputs until the row layer is called: its input is then the
rank's slice of what the whole row layer reads. The row layer's partial products of all ranks,
summed, plus its bias, must equal its recorded output up to rounding; a wrong layout or a size
left global gives another number (or a shape error). Nothing is communicated: the candidates of
the automatic plan are sorted out here before any rank shards anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..layout import shard_range
from ..per_rank import read, write
from ..replicated import heads_for_rank
from .probe import Probe, set_attention
from .tolerance import excess


@dataclass(frozen=True)
class Layout:
    """How one column layer is split: ``chunks`` > 1 packs equal chunks (each sharded on its
    own); ``kv`` = (heads, kv_heads) replicates KV heads (each rank its query heads' KV heads)."""

    chunks: int = 1
    kv: tuple[int, int] | None = None


@dataclass
class Candidate:
    layouts: dict[str, Layout]  # column path -> layout
    attrs: dict[tuple[str, str], int] = field(default_factory=dict)  # (module path, attr) -> per-rank value


class _Stop(Exception):
    """Raised at the row layer's input: the rest of the replayed module is not needed."""


def _out_dim(module: nn.Module) -> int:
    return 0 if isinstance(module, nn.Linear) else 1  # Conv1D stores [in, out]


def column_slice(module: nn.Module, name: str, layout: Layout, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of a column layer's parameter ``name`` under ``layout``."""
    t = getattr(module, name).detach()
    dim = _out_dim(module) if name == "weight" else 0
    if layout.kv is not None:
        heads, per = heads_for_rank(*layout.kv, tp, rank)
        size = t.shape[dim] // layout.kv[1]
        index = torch.tensor([h * size + i for h in heads for i in range(size)])
        return t.index_select(dim, index)
    parts = t.unflatten(dim, (layout.chunks, -1))
    start, end = shard_range(parts.shape[dim + 1], tp, rank)
    return parts.narrow(dim + 1, start, end - start).flatten(dim, dim + 1)


def _row_partial(module: nn.Module, x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    weight = module.weight.detach()
    if isinstance(module, nn.Linear):
        start, end = shard_range(weight.shape[1], tp, rank)
        return F.linear(x, weight[:, start:end])
    start, end = shard_range(weight.shape[0], tp, rank)
    return x @ weight[start:end]


def _sliced_forward(module: nn.Module):
    """A column layer's forward from its (sliced) weight alone, as the sharded styles compute it
    (HF's ``Conv1D.forward`` reshapes with its global ``nf``)."""
    if isinstance(module, nn.Linear):
        return lambda x: F.linear(x, module.weight, module.bias)
    return lambda x: torch.addmm(module.bias, x.reshape(-1, x.size(-1)), module.weight).view(*x.shape[:-1], -1)


def _swap_params(probe: Probe, candidate: Candidate, tp: int, rank: int) -> list:
    undo = []
    for path, layout in candidate.layouts.items():
        module = probe.module(path)
        for name in ("weight", "bias"):
            if module._parameters.get(name) is not None:
                undo.append((module, name, module._parameters[name]))
                module._parameters[name] = nn.Parameter(column_slice(module, name, layout, tp, rank),
                                                        requires_grad=False)
        module.__dict__["forward"] = _sliced_forward(module)
        undo.append((module, "forward", None))
    return undo


def _swap_attrs(probe: Probe, candidate: Candidate) -> list:
    undo = []
    for (path, attr), value in candidate.attrs.items():
        module = probe.module(path)
        holder = attr.split(".")[0]
        undo.append((module, holder, module.__dict__.get(holder, read(module, holder))))
        write(module, attr, value)
    return undo


def _rank_input(probe: Probe, lca: str, row: str, candidate: Candidate, tp: int, rank: int) -> torch.Tensor:
    """The row layer's input on rank ``rank``: the enclosing module replayed with its slices."""
    seen = {}

    def stop(module, args, kwargs):
        seen["x"] = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        raise _Stop
    undo_params, undo_attrs = _swap_params(probe, candidate, tp, rank), _swap_attrs(probe, candidate)
    handle = probe.module(row).register_forward_pre_hook(stop, with_kwargs=True)
    call = probe.calls[lca]
    try:
        with torch.no_grad():
            probe.module(lca)(*call.args, **call.kwargs)
    except _Stop:
        pass
    finally:
        handle.remove()
        for module, name, param in undo_params:
            if name == "forward":
                module.__dict__.pop("forward", None)
            else:
                module._parameters[name] = param
        for module, holder, value in reversed(undo_attrs):  # a config view wraps the original once
            module.__dict__[holder] = value
    if "x" not in seen:
        raise RuntimeError(f"{lca} returned without calling {row}")
    return seen["x"]


def simulate(probe: Probe, lca: str, row: str, candidate: Candidate, tp: int) -> tuple[float, float]:
    """(largest difference, tolerance) of the summed per-rank row outputs against the recorded
    one. Raises what the replay raises (a shape that does not fit: the candidate is wrong)."""
    set_attention(probe.model, probe.attention)
    module = probe.module(row)
    total = sum(_row_partial(module, _rank_input(probe, lca, row, candidate, tp, r), tp, r) for r in range(tp))
    if module.bias is not None:
        total = total + module.bias.detach()
    expected = probe.calls[row].value
    terms = max(*module.weight.shape, expected.shape[-2] if expected.dim() > 1 else 1)
    return excess(total.reshape(expected.shape), expected, terms)
