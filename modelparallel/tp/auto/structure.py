"""What the probe says about a model's structure: its blocks, their Megatron pairs, how each
column layer's output is read, and which inputs several column layers share.

A **block** is a child of an ``nn.ModuleList`` of same-class modules holding linear layers (the
decoder layers). A **pair** is a row layer R with its column layers C: C is the set of linear
layers nearest upstream of R's input in the autograd graph, all in R's block, and R is the only
linear layer downstream of each of them. Between C and R every computation is per feature (an
activation, a gate) or per head (attention): what Megatron's column -> row split needs, and
what the simulation then checks. A linear layer of a block in no pair cannot be placed.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from .probe import LINEAR, Probe


@dataclass
class Pair:
    block: str  # the block's path (``model.layers.0``)
    columns: list[str]  # full paths
    row: str
    lca: str  # the innermost module holding all of them: replayed by the simulation
    replicated: list[str] = field(default_factory=list)  # modules with parameters used between them


def common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    out = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        out.append(segs[0])
    return ".".join(out)


def find_blocks(model: nn.Module) -> list[str]:
    """Paths of the blocks (children of the outermost ``ModuleList`` s of one class with linear layers)."""
    blocks = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module) or any(path.startswith(b + ".") for b in blocks):
            continue
        if len({type(m) for m in module}) == 1 and any(isinstance(m, LINEAR) for m in module.modules()):
            blocks.extend(f"{path}.{i}" if path else str(i) for i in range(len(module)))
    return blocks


def block_of(path: str, blocks: list[str]) -> str | None:
    return next((b for b in blocks if path == b or path.startswith(b + ".")), None)


def linears(model: nn.Module, probe: Probe) -> list[str]:
    """Paths of the linear layers the probe's forward called."""
    return [p for p, m in model.named_modules() if isinstance(m, LINEAR) and probe.counts.get(p)]


def find_pairs(probe: Probe, blocks: list[str], called: list[str]) -> tuple[list[Pair], list[str], dict]:
    """(pairs, linear layers of blocks in no pair, consumers: path -> the linear layers reading it)."""
    stops = {probe.out_node(p): p for p in called if probe.out_node(p) is not None}
    producers = {p: probe.producers(p, stops) for p in called}
    consumers = defaultdict(set)
    for p, found in producers.items():
        for q in found:
            consumers[q].add(p)
    owners = {id(p): path for path, m in probe.model.named_modules() for p in m.parameters(recurse=False)}
    pairs = []
    for row in called:
        block, columns = block_of(row, blocks), producers[row]
        if block and columns and all(block_of(c, blocks) == block and consumers[c] == {row} for c in columns):
            cols = sorted(columns)
            inside = sorted({owners[id(p)] for p in probe.region_params[row] if id(p) in owners})
            pairs.append(Pair(block, cols, row, common_prefix([*cols, row]), inside))
    placed = {p for pair in pairs for p in (*pair.columns, pair.row)}
    unplaced = [p for p in called if block_of(p, blocks) and p not in placed]
    return pairs, unplaced, consumers


def _dim(node, saved_sizes) -> int:
    d = node._saved_dim
    d = d - 2**64 if d >= 2**63 else d
    return d % len(saved_sizes)


def chunk_hint(probe: Probe, column: str) -> int:
    """How many equal chunks the code cuts a column layer's output into along its features
    (``split``, ``chunk``, slices: a fused q|k|v or gate|up), 1 if none; 0 for chunks of unequal
    sizes (which a packed layout cannot hold)."""
    node = probe.out_node(column)
    readers = probe.consumers.get(node, [])
    slices, splits = [], []
    for n in readers:
        name = type(n).__name__
        if name in ("SplitBackward0", "SplitWithSizesBackward0", "SliceBackward0"):
            sizes = tuple(n._saved_self_sym_sizes)
            if _dim(n, sizes) != len(sizes) - 1:
                continue
            if name == "SliceBackward0":
                slices.append((n._saved_start, min(n._saved_end, sizes[-1]), sizes[-1]))
            elif name == "SplitBackward0":
                splits.append([n._saved_split_size] * -(-sizes[-1] // n._saved_split_size))
            else:
                splits.append(list(n._saved_split_sizes))
    for widths in splits:
        return len(widths) if len(set(widths)) == 1 else 0
    if slices:
        widths = [end - start for start, end, _ in sorted(set(slices))]
        covered = sum(widths) == slices[0][2]
        return len(widths) if covered and len(set(widths)) == 1 else 0
    return 1


def _arg_name(module: nn.Module, args: tuple, kwargs: dict, tensor: torch.Tensor) -> str | None:
    names = list(inspect.signature(module.forward).parameters)
    for i, a in enumerate(args):
        if a is tensor and i < len(names):
            return names[i]
    return next((k for k, v in kwargs.items() if v is tensor), None)


def shared_inputs(probe: Probe, pairs: list[Pair]) -> dict[str, tuple[str, str]]:
    """Module path -> ("arg", name) or ("output_of", child): the one tensor all column layers
    under it read, for every group of column layers of a block reading the same tensor."""
    out = {}
    by_block = defaultdict(list)
    for pair in pairs:
        by_block[pair.block].extend(pair.columns)
    for block, columns in by_block.items():
        groups = defaultdict(list)
        for c in columns:
            groups[id(probe.calls[c].input)].append(c)
        for group in groups.values():
            if len(group) < 2:
                continue
            owner = common_prefix(group)
            if sorted(c for c in columns if c.startswith(owner + ".")) != sorted(group):
                continue  # another column layer under the owner reads something else
            tensor, call = probe.calls[group[0]].input, probe.calls[owner]
            name = _arg_name(probe.module(owner), *call.live, tensor)
            if name:
                out[owner] = ("arg", name)
                continue
            child = next((p for p, c in probe.calls.items() if p.startswith(owner + ".") and c.output is tensor), None)
            if child:
                out[owner] = ("output_of", child[len(owner) + 1:])
    return out
