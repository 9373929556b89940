"""Cross-entropy on vocabulary-sharded logits, so training never gathers the full logits.

Gathering [tokens, vocab] logits costs vocab/hidden times one layer's all-reduce. Instead each
rank keeps its vocabulary slice and the softmax statistics are combined with two all-reduces of
[tokens] floats (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019).

PyTorch's ``loss_parallel`` computes the same thing but requires the backward pass to run inside
its context manager, which breaks plain ``loss.backward()`` and trainers that call it; this
autograd function has no such requirement.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .layout import shard_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, group):
        # logits: [N, V_local] this rank's vocabulary slice; target: [N] global token ids
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        local_t = target - vocab_start
        here = (local_t >= 0) & (local_t < logits.size(-1))
        local_t = local_t.clamp(0, logits.size(-1) - 1)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * here
        exp = shifted.exp_()
        stats = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(stats, group=group)
        sum_exp, target_logit = stats
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit) * valid
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_t, here & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, hit, valid = ctx.saved_tensors
        scale = (grad_loss * valid).unsqueeze(-1)  # d loss_i / d logit_ij = g_i (softmax_ij - [j = t_i])
        grad = softmax * scale  # one pass over the [N, V_local] tensor
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(hit * scale.squeeze(-1)).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: DTensor, target: torch.Tensor, ignore_index: int = -100,
                                 num_items_in_batch=None) -> torch.Tensor:
    """Mean (or sum / ``num_items_in_batch``) cross-entropy of vocab-sharded ``logits`` [N, V].

    Reduces like HF's ``fixed_cross_entropy``; returns a plain tensor, equal on every TP rank.
    """
    mesh = logits.device_mesh
    start, _ = shard_range(logits.shape[-1], mesh.size(), mesh.get_local_rank())
    local = logits.to_local()
    losses = _VocabParallelCrossEntropy.apply(local, target.to(local.device), start, ignore_index,
                                              mesh.get_group())
    if num_items_in_batch is not None:
        return losses.sum() / num_items_in_batch
    return losses.sum() / (target != ignore_index).sum()


def causal_lm_loss(logits: DTensor, labels: torch.Tensor, ignore_index: int = -100, num_items_in_batch=None,
                   shift_labels=None) -> torch.Tensor:
    """HF's ``ForCausalLMLoss`` (predict token t+1 from position t) on vocab-sharded logits."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return vocab_parallel_cross_entropy(logits.view(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                        ignore_index, num_items_in_batch)


def masked_lm_loss(logits: DTensor, labels: torch.Tensor, ignore_index: int = -100, num_items_in_batch=None,
                   shift_labels=None) -> torch.Tensor:
    """HF's masked-LM loss (labels aligned with positions, -100 ignored) on vocab-sharded logits."""
    return vocab_parallel_cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index,
                                        num_items_in_batch)


_LOSS_KWARGS = ("labels", "num_items_in_batch", "shift_labels")


def _take_labels(module, args, kwargs):
    """Keep the labels away from HF's own loss code, which cannot read vocab-sharded logits."""
    module._mp_pending_labels = {k: kwargs.pop(k) for k in _LOSS_KWARGS if kwargs.get(k) is not None}
    return args, kwargs


LOSSES = {"causal": causal_lm_loss, "masked": masked_lm_loss}


def _kind_by_name(module: nn.Module) -> str:
    """For a model no architecture declares a loss for: masked for ``*MaskedLM`` classes, else causal."""
    return "masked" if "MaskedLM" in type(module).__name__ else "causal"


def _loss_or_full_logits(kind, module, args, kwargs, output):
    """With labels: compute the loss on sharded logits and leave them sharded (no gather in
    training). Without: hand back full logits, as HF would, so ``generate()`` and user code see
    plain tensors."""
    taken = module.__dict__.pop("_mp_pending_labels", {})
    logits = getattr(output, "logits", None)
    if not isinstance(logits, DTensor):
        return output
    if "labels" not in taken:
        output.logits = logits.full_tensor()
        return output
    loss_fn = LOSSES[kind or _kind_by_name(module)]
    loss = loss_fn(logits, taken["labels"], num_items_in_batch=taken.get("num_items_in_batch"),
                   shift_labels=taken.get("shift_labels"))
    aux = getattr(output, "aux_loss", None)
    if aux is not None and getattr(module, "router_aux_loss_coef", None) is not None:
        loss = loss + module.router_aux_loss_coef * aux  # a mixture-of-experts head adds it, as HF's forward does
    return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})


def install_vocab_parallel_loss(model: nn.Module, kind: str | None = None) -> None:
    """Compute ``model``'s LM loss with the vocab-parallel cross-entropy; gather logits only when
    no loss is asked for.

    Args:
        model: the top-level model whose output carries the logits.
        kind: ``"causal"`` or ``"masked"``, as its architecture declares for this head class;
            None (no declaration) decides by the class name: masked for ``*MaskedLM``, else causal.
    """
    model.register_forward_pre_hook(_take_labels, with_kwargs=True)
    model.register_forward_hook(partial(_loss_or_full_logits, kind), with_kwargs=True)
