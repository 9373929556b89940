"""``MoEConfig``'s routing options on a Hugging Face MoE model: which experts a token goes to, and
the router losses added to the model's loss.

- ``aux_loss``: HF's router; its auxiliary load-balancing loss (Switch Transformer, HF's
  ``load_balancing_loss_func`` over this forward's tokens) is added to the loss weighted by
  ``moe_aux_loss_coeff`` (the model's ``output_router_logits`` is switched on for it).
- ``sinkhorn``: while training, each token's top-k experts are chosen on the router probabilities
  balanced by Sinkhorn-Knopp iterations over this forward's tokens (BASE layers, Lewis et al.
  2021, as Megatron-Core routes), and weighted by the plain softmax of its router logits (the
  sigmoid for top-1), gathered at the chosen experts; in evaluation HF's router is used as is.
  No auxiliary loss.
- ``none``: HF's router, no auxiliary loss.
- ``moe_z_loss_coeff`` > 0: the router z-loss (ST-MoE, Zoph et al. 2022), the mean over tokens
  of ``logsumexp(router_logits)^2``, times the coefficient, summed over the MoE layers and added
  to the model's loss whenever the model computes one (``labels`` given).

Every quantity is computed over the tokens of one forward on one rank, so it does not depend on
the expert-parallel degree (each rank routes its own tokens with the replicated router).
"""

from __future__ import annotations

import torch
from torch import nn

SINKHORN_TOL = 1e-4
"""Stop when the mean change of the experts' scaling falls below this."""
SINKHORN_MAX_ITER = 1000


def sinkhorn(cost: torch.Tensor, tol: float = SINKHORN_TOL) -> torch.Tensor:
    """``exp(cost)`` ([tokens, experts]) scaled by one factor per token and one per expert so
    that every token's row sums to 1 / tokens and every expert's column to 1 / experts.

    Raises:
        RuntimeError: the iterations do not converge (non-finite scores).
    """
    k = torch.exp(cost)
    tokens, experts = k.shape
    col = torch.ones(experts, dtype=k.dtype, device=k.device)
    for _ in range(SINKHORN_MAX_ITER):
        row = 1.0 / (tokens * (k @ col + 1e-8))
        new_col = 1.0 / (experts * (row @ k + 1e-8))
        change = (new_col - col).abs().mean().item()
        col = new_col
        if change <= tol:
            return k * row[:, None] * col[None, :]
    raise RuntimeError(f"Sinkhorn routing did not converge in {SINKHORN_MAX_ITER} iterations "
                       f"(router logits up to {cost.abs().max().item():.3g})")


def sinkhorn_route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``dtype``, expert indices [T, k]) for router ``logits`` [T, E]."""
    with torch.no_grad():
        index = torch.topk(sinkhorn(logits.float()), top_k, dim=-1).indices
    probs = torch.sigmoid(logits.float()) if top_k == 1 else torch.softmax(logits.float(), dim=-1)
    return torch.gather(probs, 1, index).to(dtype), index


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The router z-loss of one layer: mean over tokens of ``logsumexp(logits)^2``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class RoutedForward:
    """Forward of a router with ``MoEConfig``'s options: HF's router, then Sinkhorn selection
    (training only) and the z-loss recorded for the model's loss."""

    def forward(self, hidden_states):
        logits, weights, index = super().forward(hidden_states)
        options = self.__dict__["_mp_routing"]
        if options.sinkhorn and self.training:
            weights, index = sinkhorn_route(logits, index.shape[-1], weights.dtype)
        if options.z_loss_coeff > 0:
            options.z_losses.append(z_loss(logits))
        return logits, weights, index


class RoutingOptions:
    """What the routers of one model do: Sinkhorn selection, and the z-loss terms of the running
    forward (filled by the routers, added to the loss and emptied by the model's forward hook)."""

    def __init__(self, sinkhorn: bool, z_loss_coeff: float):
        self.sinkhorn, self.z_loss_coeff = sinkhorn, z_loss_coeff
        self.z_losses: list[torch.Tensor] = []


def _routed_classes(routers: list[nn.Module]) -> dict[type, type]:
    """Router class -> its ``RoutedForward`` subclass, one per class among ``routers`` (made per
    model: the library keeps no table of the classes it made)."""
    return {cls: type(f"Routed{cls.__name__}", (RoutedForward, cls), {}) for cls in {type(r) for r in routers}}


def _start_forward(options: RoutingOptions):
    def hook(module, args, kwargs):
        options.z_losses.clear()
    return hook


def _add_z_loss(options: RoutingOptions):
    def hook(module, args, kwargs, output):
        terms, options.z_losses = options.z_losses, []
        if not terms:
            return output
        extra = options.z_loss_coeff * torch.stack(terms).sum()
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + extra.to(output.loss.dtype)
        elif isinstance(output, tuple) and kwargs.get("labels") is not None:
            output = (output[0] + extra.to(output[0].dtype), *output[1:])
        return output
    return hook


def apply_routing(model: nn.Module, routers: list[nn.Module], load_balancing: str, aux_loss_coeff: float,
                  z_loss_coeff: float) -> None:
    """Give ``model`` (the top-level HF model) and its ``routers`` the routing options."""
    coeff = aux_loss_coeff if load_balancing == "aux_loss" else 0.0
    model.config.router_aux_loss_coef = coeff
    if hasattr(model, "router_aux_loss_coef"):
        model.router_aux_loss_coef = coeff
    if load_balancing == "aux_loss":
        model.config.output_router_logits = True
    options = RoutingOptions(load_balancing == "sinkhorn", z_loss_coeff)
    if not options.sinkhorn and z_loss_coeff == 0:
        return
    routed = _routed_classes(routers)
    for router in routers:
        router.__dict__["_mp_routing"] = options
        router.__class__ = routed[type(router)]
    if z_loss_coeff > 0:
        model.register_forward_pre_hook(_start_forward(options), with_kwargs=True)
        model.register_forward_hook(_add_z_loss(options), with_kwargs=True)
