"""Every parameter of a parallelized model is a DTensor: the ones left whole become ``Replicate()``.

Why: ``torch.optim``'s multi-tensor (``foreach``, the default on CUDA) and ``fused`` kernels take
one list per device and dtype, and a list mixing DTensors and plain tensors is refused (``got
mixed torch.Tensor and DTensor``). A tensor-parallel model holds both: the planned layers'
shards, and the modules kept whole on every TP rank (position embeddings, norms, a MoE router,
every module of a pipeline stage that no rule covers). So, as PyTorch's and torchtitan's
parallel styles do (torchtitan's ``NoParallel`` for the router), the whole ones become
``Replicate()`` DTensors on the tensor-parallel mesh. DTensors on different meshes in one list
are fine in torch's foreach and fused optimizer kernels (the TP mesh, the expert-parallel mesh,
FSDP2's data x tensor mesh): each runs on the local tensors.

Such a module still computes on plain tensors: for the duration of its forward each DTensor
parameter is shadowed by its local tensor (``to_local()``: no communication, and in the
backward the gradient comes back as a ``Replicate()`` DTensor, again without communication).
The arithmetic is the single-process model's, operation for operation, and the inputs and
outputs stay what the rest of the model exchanges.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

_NAMES = "_mp_local_view_names"  # the module's parameters shadowed by their local tensors in forward
_SAVED = "_mp_local_view_saved"  # what the module's __dict__ held under those names before
_MISSING = object()


def _shadow_with_local(module: nn.Module, args) -> None:
    """Forward pre-hook: each listed parameter (whatever holds it now: the module's own, or a view
    a data-parallel wrapper put in its place) read as its local tensor until the forward ends."""
    saved = []
    for name in module.__dict__[_NAMES]:
        current = getattr(module, name)
        saved.append(module.__dict__.get(name, _MISSING))
        if isinstance(current, DTensor):
            module.__dict__[name] = current.to_local()
    module.__dict__.setdefault(_SAVED, []).append(saved)


def _restore(module: nn.Module, args, output) -> None:
    """Forward hook (also after an exception): put back what the pre-hook shadowed (nothing when
    an earlier pre-hook raised before it ran)."""
    stack = module.__dict__.get(_SAVED)
    if not stack:
        return
    saved = stack.pop()
    for name, before in zip(module.__dict__[_NAMES], saved):
        if before is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = before


def _as_replicated(p: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """``p`` as a ``Replicate()`` DTensor parameter on ``mesh`` sharing its storage, with its
    attributes (no communication: every rank already holds the same values)."""
    new = nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                       requires_grad=p.requires_grad)
    new.__dict__.update({k: v for k, v in p.__dict__.items() if k not in new.__dict__})
    return new


def replicate_plain_parameters(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """When ``model`` holds any DTensor parameter, make every parameter that is not one a
    ``Replicate()`` DTensor on ``mesh`` (a tied parameter stays one tensor), and have its module
    compute on the local tensor. A model with no DTensor parameter (nothing was sharded) is left
    as it is: its parameters do not mix either.

    Call it once every parallel dimension has placed its parameters, so that nothing else
    creates plain parameters afterwards. Works on the meta device too (the DTensor's local
    tensor is then on meta and is materialized like any other).

    Returns:
        The dotted names of the parameters converted (each tie under its first name).
    """
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return []
    converted: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old kept alive, new)
    names = []
    for path, module in model.named_modules(remove_duplicate=False):
        plain = [(n, p) for n, p in module._parameters.items()
                 if p is not None and (id(p) in converted or not isinstance(p, DTensor))]
        if not plain:
            continue
        for name, p in plain:
            if id(p) not in converted:
                converted[id(p)] = (p, _as_replicated(p, mesh))
                names.append(f"{path}.{name}" if path else name)
            module._parameters[name] = converted[id(p)][1]
        _install(module, [n for n, _ in plain])
    return names


def _install(module: nn.Module, names: list[str]) -> None:
    """Shadow ``names`` by their local tensors during ``module``'s forward (once per module)."""
    if _NAMES in module.__dict__:
        module.__dict__[_NAMES] = tuple(dict.fromkeys((*module.__dict__[_NAMES], *names)))
        return
    module.__dict__[_NAMES] = tuple(names)
    module.register_forward_pre_hook(_shadow_with_local)
    module.register_forward_hook(_restore, always_call=True)
