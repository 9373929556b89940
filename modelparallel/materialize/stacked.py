"""Hub checkpoints of mixture-of-experts models, read shard by shard.

Transformers 5 holds each MoE layer's experts stacked (``experts.gate_up_proj [E, 2I, H]``), but
checkpoints on the Hugging Face hub store each expert's projections as separate tensors (Mixtral's
``block_sparse_moe.experts.{e}.w1 / w3 / w2``). The architecture's key table says which
(``KeyTable.stacked``); here a stacked tensor is matched with those per-expert tensors (shapes
checked from the headers) and each rank reads only the experts of its own block.
"""

from __future__ import annotations

import torch

from ..tp.layout import block_of, block_slices
from . import safetensors_io


def expert_parts(table, name: str, t: torch.Tensor, shapes: dict[str, tuple], files: dict[str, str],
                 problems: list[str]) -> list[list[str]] | None:
    """The per-expert checkpoint keys (one list per concatenated part, experts in order) of the
    model's stacked experts tensor ``name``, or None when the checkpoint holds none of them.
    Shapes that do not add up are appended to ``problems``, naming the file and expert."""
    parts = table.expert_keys(name, t.shape[0]) if t.dim() == 3 else []
    keys = [k for part in parts for k in part]
    if not keys or not any(k in shapes for k in keys):
        return None
    absent = [k for k in keys if k not in shapes]
    if absent:
        problems.append(f"{name}: the checkpoint holds only some of its per-expert tensors (no {absent[:3]}...)")
        return parts
    for e in range(t.shape[0]):
        got = [shapes[part[e]] for part in parts]
        if any(g[1:] != tuple(t.shape[2:]) for g in got) or sum(g[0] for g in got) != t.shape[1]:
            problems.append(f"{files[parts[0][e]]}: {name} expert {e}: the checkpoint holds {got}, the model "
                            f"(its config) expects {tuple(t.shape[1:])} in {len(parts)} parts")
            break
    return parts


def read_stacked(files: dict[str, str], parts: list[list[str]], target: torch.Tensor) -> torch.Tensor:
    """This rank's block of a stacked experts tensor from a hub checkpoint's per-expert tensors:
    only the experts of the block are read, each part whole, concatenated, then cut to the block."""
    shape, offset = block_of(target)
    rows = []
    for e in range(offset[0], offset[0] + shape[0]):
        pieces = []
        for part in parts:
            with safetensors_io.open_file(files[part[e]]) as h:
                pieces.append(h.get_tensor(part[e]))
        rows.append(torch.cat(pieces)[block_slices(shape[1:], offset[1:])])
    return torch.stack(rows) if rows else torch.empty(shape)
