"""The expert-sharding style: an experts module's stacked tensors split on the expert dimension.

``ExpertParallel`` is a PyTorch ``ParallelStyle`` for a Hugging Face experts module
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``): over a 1-D expert-parallel mesh each
stacked parameter becomes a DTensor ``Shard(0)``, so rank r holds experts ``r * E / ep`` to
``(r + 1) * E / ep - 1`` and every state dict, checkpoint and loader sees the global ``[E, ...]``
tensor indexed by global expert (a checkpoint saved at one degree loads at any other). The
module's class is swapped for a subclass whose forward dispatches the tokens (``dispatch``); the
parameters' names, shapes and HF's attributes are unchanged.

Gradients: an expert's gradient on its rank sums the contributions of every token the
expert-parallel group sent it, i.e. of ``ep`` ranks' batches. It is scaled by 1 / ep on its way
into the weights, so it is the mean over the group's batches, as a dense parameter's gradient is
the mean over its own rank's: any data-parallel average over the expert's replicas (the ranks
holding the same experts: ``edp`` of them) then gives the average over all ``ep x edp``
data-parallel batches, the same as for the dense parameters, whichever wrapper averages
(``DistributedModel``, FSDP1, FSDP2).

Expert tensor parallelism (``tensor_parallel.py``): over a 2-D ``("ep", "tp")`` mesh the stacked
parameters are ``[Shard(0), Shard(1)]`` (``gate_up_proj``, column parallel) and ``[Shard(0),
Shard(2)]`` (``down_proj``, row parallel); tokens are dispatched over "ep" as above, each rank of
a tensor-parallel group dispatching the same tokens to its peers of the same tp rank, and the
partial outputs are summed over "tp". No gradient scale over "tp": its ranks share one batch.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..tp.layout import distribute
from ..tp.local import copy_to_tp, reduce_from_tp
from .dispatch import compute_local, dispatch_all_gather, dispatch_all_to_all
from .tensor_parallel import expert_ffn_tensor_parallel

WEIGHTS = ("gate_up_proj", "down_proj")
"""The stacked parameters of HF's experts modules, expert index first."""


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class ExpertParallelForward:
    """Forward of an experts module whose stacked weights are ``Shard(0)`` DTensors over "ep"
    (with expert tensor parallelism, also split over "tp"): HF's signature and result, the tokens
    dispatched to the ranks holding their experts (at ep 1, computed in place) and, over "tp",
    Megatron's ``f`` on the inputs and ``g`` on the partial outputs."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        mesh = self.gate_up_proj.device_mesh
        ep_mesh, tp_mesh = (mesh["ep"], mesh["tp"]) if mesh.ndim == 2 else (mesh, None)
        scale = 1.0 / ep_mesh.size()
        gate_up = _ScaleGrad.apply(self.gate_up_proj.to_local(), scale)
        down = _ScaleGrad.apply(self.down_proj.to_local(), scale)
        dispatch = dispatch_all_to_all if self.__dict__.get("_mp_all_to_all", True) else dispatch_all_gather
        if tp_mesh is None:
            return dispatch(self, hidden_states, top_k_index, top_k_weights, gate_up, down, ep_mesh.get_group())
        ffn = functools.partial(expert_ffn_tensor_parallel, group=tp_mesh.get_group())
        x, weights = copy_to_tp(hidden_states, tp_mesh), copy_to_tp(top_k_weights, tp_mesh)
        if ep_mesh.size() == 1:
            out = compute_local(self, x, top_k_index, weights, gate_up, down, ffn)
        else:
            out = dispatch(self, x, top_k_index, weights, gate_up, down, ep_mesh.get_group(), ffn)
        return reduce_from_tp(out.contiguous(), tp_mesh)


def _expert_parallel_class(cls: type) -> type:
    """``cls`` with the dispatching forward: one subclass per HF experts class, made once and
    kept on ``cls`` itself (its own ``__dict__``, not inherited), so the library holds no table."""
    made = cls.__dict__.get("_mp_expert_parallel_class")
    if made is None:
        made = type(f"ExpertParallel{cls.__name__}", (ExpertParallelForward, cls), {})
        setattr(cls, "_mp_expert_parallel_class", made)
    return made


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module sharded by ``ExpertParallel``."""
    return isinstance(module, ExpertParallelForward)


PLACEMENTS = {1: {"gate_up_proj": [Shard(0)], "down_proj": [Shard(0)]},
              2: {"gate_up_proj": [Shard(0), Shard(1)], "down_proj": [Shard(0), Shard(2)]}}
"""The stacked parameters' placements over an ``("ep",)`` mesh and an ``("ep", "tp")`` one
(expert tensor parallelism: gate/up rows column parallel, down columns row parallel)."""


class ExpertParallel(ParallelStyle):
    """Shard an HF experts module over a 1-D expert-parallel mesh, or over a 2-D ``("ep", "tp")``
    mesh with expert tensor parallelism (see the module docstring). Torch's
    ``parallelize_module`` takes 1-D meshes only: ``apply`` takes both.

    Args:
        all_to_all: dispatch tokens by all-to-all (True) or by all-gather / reduce-scatter.
    """

    def __init__(self, all_to_all: bool = True):
        super().__init__()
        self.all_to_all = all_to_all

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Shard ``module`` over ``device_mesh`` (``("ep",)`` or ``("ep", "tp")``), in place."""
        return self._apply(module, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placements = PLACEMENTS[device_mesh.ndim]
        for name in WEIGHTS:
            param = getattr(module, name)
            sharded = distribute(param.detach(), device_mesh, placements[name])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__dict__["_mp_all_to_all"] = self.all_to_all
        module.__class__ = _expert_parallel_class(type(module))
        return module
