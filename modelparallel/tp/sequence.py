"""Megatron's sequence parallelism inside tensor parallelism (Korthikanti et al. 2022, sec. 4.2.2).

Between its column- and row-parallel layers a TP block keeps a full copy of the hidden states on
every rank: norms, dropout and residual adds repeat the same work T times. With sequence
parallelism the hidden states between those regions are split along the sequence (dim 1): rank r
holds tokens [r S/T, (r + 1) S/T). The block's column-parallel region gathers the sequence on its
way in (Megatron's ``g``: all-gather forward, reduce-scatter backward) in place of ``f``, and its
row-parallel layer reduce-scatters on its way out (``g-bar``: reduce-scatter forward, all-gather
backward) in place of the all-reduce: the same bytes as the two all-reduces. Norms run on the
sequence shard, and so does every replicated module inside a block (a MoE router and its
experts, which route token by token): each computes locally on this rank's tokens and the
gradients of its parameters, partial per rank, are summed over the ranks (the
``replicated_grad_sum`` style, Megatron's all-reduce of its sequence-parallel parameters' grads);
a row-parallel bias is added to the shard, its gradient summed likewise.

The split dimension is the tokens' (a tensor's second-to-last; the sequence, dim 1, of
[batch, seq, hidden]): a block that flattens its hidden states to [batch x seq, hidden] (OPT's
feed-forward) holds this rank's tokens in dim 0, which the gather concatenates in rank order and
the reduce-scatter hands back to the same rank, and token-wise layers do not mind the order.

The split region is the model's repeated blocks: the first block's input is cut (backward:
all-gathered) and the last block's output gathered (backward: each rank keeps its slice, since
everything after the blocks runs alike on every TP rank). Where a block's attention or MLP reads
its own input's shape, the plan's ``SharedInput`` gathers at that module's entry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .layout import base_prefix
from .plan import block_prefix, glob_match, join

SEQ_DIM = 1
"""The sequence dimension of the blocks' [batch, seq, hidden] input and output."""


def token_dim(x: torch.Tensor) -> int:
    """The dimension of ``x`` (hidden states, [..., tokens, hidden]) that sequence parallelism splits."""
    return x.dim() - 2


SEQUENCE_PARALLEL = "_mp_sequence_parallel"
"""Attribute the walker sets on a column or row layer inside the blocks sequence parallelism splits."""


def _back(front: torch.Tensor, dim: int) -> torch.Tensor:
    """A [S, B, ...] result as a new contiguous [B, S, ...] tensor (never a view: layers add to
    their outputs in place)."""
    out = front.new_empty(front.movedim(0, dim).shape)
    return out.copy_(front.movedim(0, dim))


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/T, H] shards -> [B, S, H] in rank order ([N/T, H] -> [N, H])."""
    size, dim = torch.distributed.get_world_size(group), token_dim(x)
    front = x.movedim(dim, 0).contiguous()
    out = torch.ops._c10d_functional.all_gather_into_tensor(front, size, group.group_name)
    return _back(torch.ops._c10d_functional.wait_tensor(out), dim)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, H] partial sums -> this rank's [B, S/T, H] slice of their sum ([N, H] -> [N/T, H])."""
    size, dim = torch.distributed.get_world_size(group), token_dim(x)
    front = x.movedim(dim, 0).contiguous()
    out = torch.ops._c10d_functional.reduce_scatter_tensor(front, "sum", size, group.group_name)
    return _back(torch.ops._c10d_functional.wait_tensor(out), dim)


def _slice(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    return x.chunk(size, dim=token_dim(x))[rank].contiguous()


class _Regather:
    """The gathered sequence as the column-parallel layers save it for their weight gradients:
    this rank's shard, all-gathered again when backward first needs it (Megatron keeps the shard,
    not the whole sequence, the same way). One object per gather, so layers sharing an input
    (q, k, v) save it once."""

    def __init__(self, shard: torch.Tensor, group):
        self.shard, self.group, self.total = shard, group, None

    def get(self) -> torch.Tensor:
        if self.total is None:
            self.total = _gather(self.shard, self.group)
        return self.total


_REGATHER = "_mp_regather"


def _pack(t: torch.Tensor):
    base = t if hasattr(t, _REGATHER) else t._base
    regather = getattr(base, _REGATHER, None) if base is not None else None
    if regather is None or t.numel() != base.numel() or not t.is_contiguous():
        return t
    return regather, t.shape  # the whole gathered tensor (or a reshape of it): keep the shard


def _unpack(packed):
    if isinstance(packed, tuple):
        regather, shape = packed
        return regather.get().view(shape)
    return packed


def keep_shards(module: nn.Module):
    """Around a column-parallel layer's compute: under sequence parallelism its gathered input is
    saved as this rank's shard (elsewhere: nothing changes)."""
    if not getattr(module, SEQUENCE_PARALLEL, False):
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


class _GatherSequence(torch.autograd.Function):
    """Into a column-parallel region: all-gather forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = _gather(x, group)
        setattr(total, _REGATHER, _Regather(x.detach(), group))
        return total

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Out of a row-parallel layer: reduce-scatter forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class _EnterSequence(torch.autograd.Function):
    """Into the split region (the first block's input, alike on every rank): keep this rank's
    slice; backward, the slices' gradients are gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class _LeaveSequence(torch.autograd.Function):
    """Out of the split region (the last block's output): gathered; backward, the gradient is
    the same on every rank (what follows runs alike), so each keeps its slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The full sequence into a column-parallel region (replaces ``f``)."""
    return _GatherSequence.apply(x, mesh.get_group())


def reduce_scatter_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's sequence shard of a row-parallel layer's summed output (replaces ``g``)."""
    return _ReduceScatterSequence.apply(x, mesh.get_group())


def check_length(length: int, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` divides the sequence ``length``."""
    if length % tp:
        raise ValueError(f"sequence_parallel: the sequence length {length} is not divisible by "
                         f"tensor_parallel_degree {tp} (each TP rank holds an equal part of the sequence)")


def _first_arg(args: tuple, kwargs: dict, fn):
    """Apply ``fn`` to a block's hidden states (``hidden_states`` or its first argument)."""
    if "hidden_states" in kwargs:
        kwargs = {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    else:
        args = (fn(args[0]), *args[1:])
    return args, kwargs


def _bounds(blocks: list[nn.Module], mesh: DeviceMesh) -> None:
    """Cut the sequence at the first block's input, gather it at the last block's output."""
    group, tp = mesh.get_group(), mesh.size()

    def enter(module, args, kwargs):
        def cut(x):
            check_length(x.shape[SEQ_DIM], tp)
            return _EnterSequence.apply(x, group)
        return _first_arg(args, kwargs, cut)

    def leave(module, args, kwargs, output):
        if isinstance(output, torch.Tensor):
            return _LeaveSequence.apply(output, group)
        return (_LeaveSequence.apply(output[0], group), *output[1:])

    blocks[0].register_forward_pre_hook(enter, with_kwargs=True)
    blocks[-1].register_forward_hook(leave, with_kwargs=True)


def _replicated(module: nn.Module) -> bool:
    return any(p is not None and not isinstance(p, DTensor) for p in module._parameters.values())


def blocks(model: nn.Module, spec) -> list[tuple[str, nn.Module]]:
    """(path, module) of the repeated blocks of ``spec``'s base plan (``layers.*``, ``h.*``...),
    in model order: the region sequence parallelism splits."""
    prefix = base_prefix(model)
    globs = {join(prefix, b) for b in map(block_prefix, spec.base.rules) if b}
    return [(path, m) for path, m in model.named_modules() if path and any(glob_match(g, path) for g in globs)]


def problems(found: list[tuple[str, nn.Module]]) -> list[str]:
    """Why sequence parallelism cannot split these blocks (none found; a replicated module with
    parameters whose children hold parameters too: whether its own meet this rank's tokens or
    the gathered sequence its children may see is not known)."""
    if not found:
        return ["sequence_parallel: the plan has no repeated blocks (rules with '*') to split"]
    out = []
    for path, block in found:
        for rel, module in block.named_modules():
            if _replicated(module) and any(True for c in module.children() for _ in c.parameters()):
                out.append(f"sequence_parallel: {path}.{rel} holds parameters and submodules with parameters; "
                           "only leaf modules (norms) run on sequence shards")
    return out


def inside(path: str, blocks: list[str]) -> bool:
    """Whether module ``path`` is one of ``blocks`` or inside one."""
    return any(path == b or path.startswith(b + ".") for b in blocks)


_SPLIT_STYLES = ("colwise", "packed_colwise", "rowwise")


def apply(found: list[tuple[str, nn.Module]], mesh: DeviceMesh, layers: list[tuple[str, nn.Module, str]],
          on_shard: Callable[[nn.Module], object]) -> list[str]:
    """Split the hidden states between the TP regions of the blocks ``found`` over ``mesh``.

    The column and row layers among ``layers`` (path, module, style name; already sharded) that
    sit inside the blocks gather and reduce-scatter the sequence; replicated modules with
    parameters inside the blocks and no style of their own (norms, a MoE router and its experts)
    run on the sequence shard, each made so by ``on_shard`` (the ``replicated_grad_sum`` style:
    a rank's gradient covers its own tokens, the sum over the ranks all of them). Returns their
    paths. The caller installs the blocks' shared inputs (gathering the sequence) afterwards."""
    paths = [p for p, _ in found]
    for path, module, style in layers:
        if style in _SPLIT_STYLES and inside(path, paths):
            setattr(module, SEQUENCE_PARALLEL, True)
    styled = {id(module) for _, module, _ in layers}  # a style of their own (Qwen3's per-head norms)
    shards = []
    for path, block in found:
        for rel, module in block.named_modules():
            if _replicated(module) and id(module) not in styled:
                on_shard(module)
                shards.append(join(path, rel))
    _bounds([b for _, b in found], mesh)
    return shards
