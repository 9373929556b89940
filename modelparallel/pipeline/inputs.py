"""A pipelined ``@smp.step``'s tensors come from the first stage, as SageMaker feeds a pipeline.

Under pipeline parallelism only the first stage reads the batch: scripts written for SageMaker
give the other stages placeholder batches (empty tensors from a dummy dataset) and expect them
to be ignored. The last stage still needs the labels, and every stage runs the step function's
code before the model call on the same inputs. So at the start of each step the first stage sends
every tensor among the step function's arguments to the other stages of its pipeline group,
which put them where their own arguments had tensors; non-tensor arguments (the model, flags)
stay each stage's own, since they cannot travel and are the same on every stage.

The structure travels as a small template (containers, tensor shapes and dtypes, and a marker
for "keep your own value"); the tensors as one broadcast each on the job's device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Keep:
    """Where the first stage has a non-tensor value: each stage keeps its own."""


def _template(value, tensors: list[torch.Tensor]):
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, Mapping):
        return ("map", {k: _template(v, tensors) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return ("seq", [_template(v, tensors) for v in value])
    return _Keep()


def _rebuild(template, own, received: list[torch.Tensor]):
    """The first stage's structure, its tensors from ``received``, every other leaf this stage's."""
    if isinstance(template, _TensorSlot):
        return received[template.index]
    if isinstance(template, _Keep):
        return own
    kind, children = template
    if kind == "map":
        mine = own if isinstance(own, Mapping) else {}
        items = {k: _rebuild(t, mine.get(k), received) for k, t in children.items()}
        return _same_container(own, items, Mapping)
    mine = own if isinstance(own, (list, tuple)) else ()
    items = [_rebuild(t, mine[i] if i < len(mine) else None, received) for i, t in enumerate(children)]
    return _same_container(own, items, (list, tuple))


def _same_container(own, items, kind):
    """``items`` in the container type this stage had there (a plain dict/list otherwise)."""
    if isinstance(own, kind):
        try:
            if isinstance(own, tuple) and hasattr(own, "_fields"):
                return type(own)(*items)
            return type(own)(items)
        except TypeError:
            pass
    return items if not isinstance(items, dict) else dict(items)


def from_first_stage(args: tuple, kwargs: dict, group: dist.ProcessGroup, is_first: bool,
                     device: torch.device) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor the first stage of ``group`` passed (a collective of
    the pipeline group; the first stage's own arguments come back unchanged).

    Args:
        args, kwargs: this stage's arguments to the step function.
        group: the pipeline group (its rank 0 is the first stage).
        is_first: whether this rank is the first stage.
        device: the job's device, where received tensors are placed.
    """
    tensors: list[torch.Tensor] = []
    box = [_template((tuple(args), dict(kwargs)), tensors) if is_first else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    template = box[0]
    if is_first:
        for t in tensors:
            dist.broadcast(t.detach().to(device).contiguous(), group=group, group_src=0)
        return args, kwargs
    received = []
    for slot in _slots(template):
        buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.broadcast(buffer, group=group, group_src=0)
        received.append(buffer)
    new_args, new_kwargs = _rebuild(template, (tuple(args), dict(kwargs)), received)
    return tuple(new_args), dict(new_kwargs)


def _slots(template) -> list[_TensorSlot]:
    """The template's tensor slots in index order (the order the first stage broadcasts them)."""
    found: list[_TensorSlot] = []

    def walk(t):
        if isinstance(t, _TensorSlot):
            found.append(t)
        elif isinstance(t, tuple) and len(t) == 2 and t[0] in ("map", "seq"):
            for child in (t[1].values() if t[0] == "map" else t[1]):
                walk(child)

    walk(template)
    return sorted(found, key=lambda s: s.index)
