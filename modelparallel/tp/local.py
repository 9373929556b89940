"""Column- and row-parallel linear layers that compute on local tensors, Megatron style.

The parameters stay DTensors (state dicts, DCP and resharding see the global tensors), but the
forward runs plain ATen ops on each rank's shard with Megatron's two operators at the layer's
boundaries (Shoeybi et al. 2019, sec. 3): ``f`` (identity forward, all-reduce of the gradient
backward) before a column-parallel layer, ``g`` (all-reduce forward, identity backward) after a
row-parallel one. Running the GEMMs on DTensors instead costs a sharding propagation and a re-wrap
per op, forward and backward, which on a GPU is host time the kernels wait for.

The backward collectives are the functional ones (``_c10d_functional``), the same DTensor issues;
the forward one is c10d's in-place all-reduce. Both work on every backend (gloo, NCCL) and are
visible to ``CommDebugMode`` and compilers. The forward sum
of a row-parallel layer runs in place on the GEMM's output, and the bias is added in place after
it: that output is a fresh tensor no autograd node saves, so reusing it is safe, and it spares a
[tokens, hidden] buffer and a copy per layer (fewer large allocations also leave the C allocator
less fragmented, which shows in peak RSS). The backward sums stay out of place: the gradient a
backward receives may be the very tensor autograd hands to another branch too.

Layouts: ``nn.Linear`` stores [out, in], HF's ``Conv1D`` [in, out]; column parallel shards ``out``,
row parallel ``in``. Each rank's shard is stored contiguous, so every GEMM reads it as is.

Under sequence parallelism (``sequence.py``; the walker sets ``_mp_sequence_parallel`` on the
layers inside the split blocks) a column layer's ``f`` becomes an all-gather of the sequence and a
row layer's ``g`` a reduce-scatter, its bias then added to the shard with a gradient summed over
the ranks.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from transformers.pytorch_utils import Conv1D

from .sequence import SEQUENCE_PARALLEL, gather_sequence, keep_shards, reduce_scatter_sequence


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: the input of column-parallel layers, its gradient summed over the ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def _all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(x, group=group)  # c10d's in-place op: the functional in-place one is not traced by CommDebugMode
    return x


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: the partial outputs of a row-parallel layer summed over the ranks, in
    place (the caller passes a fresh product that nothing else holds)."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return _all_reduce(x, group)
        ctx.mark_dirty(x)
        return _all_reduce_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``f`` over ``mesh``: identity forward, all-reduce (sum) of the gradient backward."""
    return _CopyToTP.apply(x, mesh.get_group())


def reduce_from_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``g`` over ``mesh``: all-reduce (sum) forward, in place on ``x``, identity backward. ``x``
    must be a fresh tensor no autograd node saved (a GEMM's output)."""
    return _ReduceFromTP.apply(x, mesh.get_group())


def column_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The local input of a column-parallel layer: ``x`` through ``f``, unless the plan already
    applied ``f`` once for every layer reading it (``_mp_shared_input``)."""
    mesh = module.weight.device_mesh
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    if getattr(module, "_mp_shared_input", False):
        return x
    return gather_sequence(x, mesh) if getattr(module, SEQUENCE_PARALLEL, False) else copy_to_tp(x, mesh)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


class ColwiseLinear:
    """Forward of an ``nn.Linear`` with weight Shard(0) [out/tp, in], bias Shard(0): output
    [..., out/tp]."""

    def forward(self, x):
        with keep_shards(self):
            return F.linear(column_input(self, x), self.weight.to_local(), _local(self.bias))


class ColwiseConv1D:
    """Forward of an HF ``Conv1D`` with weight Shard(1) [in, out/tp], bias Shard(0)."""

    def forward(self, x):
        x = column_input(self, x)
        with keep_shards(self):
            y = torch.addmm(self.bias.to_local(), x.reshape(-1, x.size(-1)), self.weight.to_local())
        return y.view(*x.shape[:-1], -1)


def _row_input(x: torch.Tensor) -> torch.Tensor:
    return x.redistribute(x.device_mesh, [Shard(-1)]).to_local() if isinstance(x, DTensor) else x


def _bias_like(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The bias in the product's dtype: under autocast the GEMM ran in half precision, and the
    unsharded layer (``addmm`` / ``linear``, which autocast casts whole) returns that dtype too."""
    return bias.to_local().to(y.dtype)


def _add_bias_(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y + bias`` in place on the summed product (no autograd node needs ``y`` itself)."""
    return y if bias is None else y.add_(_bias_like(bias, y))


def _row_output(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """The partial products ``y`` [..., S, out] of a row layer summed over the ranks (``g``), or
    under sequence parallelism reduce-scattered to this rank's sequence shard; then the bias (on
    a shard, its gradient is this rank's part of the sum)."""
    mesh = module.weight.device_mesh
    if not getattr(module, SEQUENCE_PARALLEL, False):
        return _add_bias_(reduce_from_tp(y, mesh), module.bias)
    y = reduce_scatter_sequence(y, mesh)
    if module.bias is None:
        return y
    return y.add_(module.bias.to_local(grad_placements=[Partial()]).to(y.dtype))


class RowwiseLinear:
    """Forward of an ``nn.Linear`` with weight Shard(1) [out, in/tp], bias replicated: ``g`` sums
    the partial products, then the bias is added once."""

    def forward(self, x):
        return _row_output(self, F.linear(_row_input(x), self.weight.to_local()))


class RowwiseConv1D:
    """Forward of an HF ``Conv1D`` with weight Shard(0) [in/tp, out], bias replicated."""

    def forward(self, x):
        x = _row_input(x)
        y = torch.mm(x.reshape(-1, x.size(-1)), self.weight.to_local())
        return _row_output(self, y.view(*x.shape[:-1], -1))


_CLASSES: dict[tuple[type, type], type] = {}


def with_forward(module: nn.Module, forward: type) -> nn.Module:
    """Give ``module`` the forward of ``forward`` (a mixin), keeping every other method of its
    class (``reset_parameters`` of a custom linear, which delayed initialization calls)."""
    cls = type(module)
    key = (forward, cls)
    if key not in _CLASSES:
        name = f"{forward.__name__}_{cls.__name__}_{len(_CLASSES)}"
        new = type(name, (forward, cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = new  # importable by name, so pickling the module works
        _CLASSES[key] = new
    module.__class__ = _CLASSES[key]
    return module


def _distribute(module: nn.Module, name: str, placements, mesh: DeviceMesh, src_data_rank) -> None:
    param = getattr(module, name)
    if param is None:
        return
    dist = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src_data_rank)
    dist = DTensor.from_local(dist.to_local().contiguous(), mesh, placements, run_check=False,
                              shape=dist.shape, stride=dist.stride())
    module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class LocalColwise(ParallelStyle):
    """The ``colwise`` style for ``nn.Linear`` and ``Conv1D``: local forward, ``f`` on entry."""

    src_data_rank = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        conv = isinstance(module, Conv1D)
        _distribute(module, "weight", [Shard(1 if conv else 0)], device_mesh, self.src_data_rank)
        _distribute(module, "bias", [Shard(0)], device_mesh, self.src_data_rank)
        return with_forward(module, ColwiseConv1D if conv else ColwiseLinear)


class LocalRowwise(ParallelStyle):
    """The ``rowwise`` style for ``nn.Linear`` and ``Conv1D``: local forward, ``g`` on exit."""

    src_data_rank = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        conv = isinstance(module, Conv1D)
        _distribute(module, "weight", [Shard(0 if conv else 1)], device_mesh, self.src_data_rank)
        _distribute(module, "bias", [Replicate()], device_mesh, self.src_data_rank)
        return with_forward(module, RowwiseConv1D if conv else RowwiseLinear)


def install_shared_input(module: nn.Module, shared, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Apply ``f`` (under sequence parallelism: the sequence all-gather) once to the tensor a
    ``plan.SharedInput`` names: the argument ``shared.arg`` of ``module``'s forward, or the
    output of its child ``shared.output_of``."""
    enter = gather_sequence if sequence_parallel else copy_to_tp
    if shared.output_of:
        module.get_submodule(shared.output_of).register_forward_hook(
            lambda mod, args, out: enter(out, mesh))
        return
    index = list(inspect.signature(module.forward).parameters).index(shared.arg)

    def hook(mod, args, kwargs):
        if shared.arg in kwargs:
            kwargs[shared.arg] = enter(kwargs[shared.arg], mesh)
        elif index < len(args):
            args = (*args[:index], enter(args[index], mesh), *args[index + 1:])
        return args, kwargs
    module.register_forward_pre_hook(hook, with_kwargs=True)
