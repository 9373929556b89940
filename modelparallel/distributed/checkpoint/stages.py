"""v2 checkpoints of a model cut into pipeline stages (``transform`` at
``pipeline_parallel_degree`` > 1).

Each stage holds other tensors, under other keys, so one DCP checkpoint over the whole job holds
every stage's tensors side by side. Two things would go wrong without this module:

- groups of different stages saving side by side (the scripts save over ``model.process_group``,
  one stage's FSDP group, into ``tp{i}_ep{j}`` directories that name no stage) would write one
  directory over each other: ``check_group`` refuses a group that leaves out a stage;
- a non-tensor entry under one key differs between stages (FSDP's optimizer ``param_groups``
  list this stage's parameter names), and DCP keeps one rank's copy of each key: ``qualified``
  stores every non-tensor entry under its key plus ``@pp<stage>``, and a load reads this stage's
  back into the original key. Tensors keep their keys (plain DCP tools read them as ever).

At pipeline degree 1 both do nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist

from ... import runtime
from ...tp.layout import rank_coordinate


def _world_mesh():
    """The job's ``[pp, dp, cp, tp]`` mesh under pipeline parallelism, else None."""
    if not runtime.is_initialized() or runtime.current().config.pipeline_parallel_degree == 1:
        return None
    return runtime.current().world_mesh


def _stage(mesh, rank: int) -> int:
    return rank_coordinate(mesh, rank)[0]  # "pp" is the mesh's first dimension


def check_group(members: list[int]) -> None:
    """Refuse a group that leaves out a pipeline stage (see the module docstring).

    Raises:
        ValueError: naming the stages the group holds and the call that works.
    """
    mesh = _world_mesh()
    if mesh is None:
        return
    held, stages = sorted({_stage(mesh, r) for r in members}), mesh.size(0)
    if len(held) < stages:
        raise ValueError(f"at pipeline_parallel_degree {stages} a checkpoint is saved and loaded by every pipeline "
                         f"stage together; this process group holds stage(s) {held} only (each stage holds other "
                         "tensors, and groups of different stages would write one directory over each other): "
                         "pass process_group=None (the world), the same path on every rank")


def _tensor_like(value) -> bool:
    return isinstance(value, torch.Tensor) or (hasattr(value, "state_dict") and hasattr(value, "load_state_dict"))


def _qualify(entries: dict, suffix: str) -> dict:
    out = copy.copy(entries)  # its own type and attributes (a local state dict's layout)
    out.clear()
    for key, value in entries.items():
        if isinstance(value, dict):
            out[key] = _qualify(value, suffix)
        elif _tensor_like(value) or not isinstance(key, str):
            out[key] = value
        else:
            out[key + suffix] = value
    return out


def _restore(entries: dict, qualified: dict, suffix: str) -> None:
    for key, value in entries.items():
        if isinstance(value, dict):
            _restore(value, qualified[key], suffix)
        elif isinstance(key, str) and key + suffix in qualified:
            entries[key] = qualified[key + suffix]
        else:
            entries[key] = qualified[key]


def qualified(state_dict: dict) -> tuple[dict, Callable[[], None]]:
    """``state_dict`` as this stage saves and loads it (new dicts, the same values; non-tensor
    entries under ``key@pp<stage>``), and a function that copies what a load put into it back
    into ``state_dict``. Without pipeline parallelism: ``state_dict`` itself and a no-op."""
    mesh = _world_mesh()
    if mesh is None or not isinstance(state_dict, dict):
        return state_dict, lambda: None
    suffix = f"@pp{_stage(mesh, dist.get_rank())}"
    mine = _qualify(state_dict, suffix)
    return mine, lambda: _restore(state_dict, mine, suffix)
