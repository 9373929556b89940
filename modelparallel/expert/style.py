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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..tp.layout import distribute
from .dispatch import dispatch_all_gather, dispatch_all_to_all

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
    """Forward of an experts module whose stacked weights are ``Shard(0)`` DTensors: HF's
    signature and result, the tokens dispatched to the ranks holding their experts."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        mesh = self.gate_up_proj.device_mesh
        group, scale = mesh.get_group(), 1.0 / mesh.size()
        gate_up = _ScaleGrad.apply(self.gate_up_proj.to_local(), scale)
        down = _ScaleGrad.apply(self.down_proj.to_local(), scale)
        dispatch = dispatch_all_to_all if self.__dict__.get("_mp_all_to_all", True) else dispatch_all_gather
        return dispatch(self, hidden_states, top_k_index, top_k_weights, gate_up, down, group)


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


class ExpertParallel(ParallelStyle):
    """Shard an HF experts module over a 1-D expert-parallel mesh (see the module docstring).

    Args:
        all_to_all: dispatch tokens by all-to-all (True) or by all-gather / reduce-scatter.
    """

    def __init__(self, all_to_all: bool = True):
        super().__init__()
        self.all_to_all = all_to_all

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in WEIGHTS:
            param = getattr(module, name)
            sharded = distribute(param.detach(), device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__dict__["_mp_all_to_all"] = self.all_to_all
        module.__class__ = _expert_parallel_class(type(module))
        return module
