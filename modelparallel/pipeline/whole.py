"""Pipeline parallelism for a model called whole: v2's ``transform`` at
``pipeline_parallel_degree`` > 1, where the script's own loop is
``loss = model(input_ids, labels=labels).loss; loss.backward(); optimizer.step()``.

Nothing schedules microbatches here: every call of the model is one batch through every stage
(GPipe with one microbatch), and autograd carries the pipeline. A stage other than the first
receives its input activation from the previous stage inside ``_Received``, whose backward sends
the activation's gradient back. A stage other than the last runs only the base model (embeddings
and its blocks; the final modules of later stages are stand-ins passing their input through),
sends the last hidden states on, and returns a loss built by ``_Sent``: its value is the last
stage's loss (broadcast over the pipeline group at the end of the forward, so every rank can log
it), its backward receives the hidden states' gradient from the next stage and back-propagates it
through this stage. The last stage runs the model's own forward (its first block's input swapped
for the received activation) and returns its output unchanged. So when every rank calls
``loss.backward()``, the last stage's backward sends first and each earlier one receives, in
chain: gradients are exactly those of the whole model on that batch (and whatever the script
multiplied the loss by, or a gradient scaler's scale, reaches every stage through the last one).

The model computes the loss (``labels=``): a stage other than the last has no logits. Weights
tied across stages and virtual stages are refused by ``check``; the bubble is that of GPipe with
one microbatch (the v1 API's ``@smp.step`` splits a batch into microbatches and runs 1F1B).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from transformers.utils import ModelOutput

from ..tp.layout import tie_groups
from .split import Elsewhere, Stage

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # dtype code, rank of the shape, the shape (at most six dimensions)
_HEAD_ONLY = ("labels", "logits_to_keep", "num_items_in_batch")
_INSTALLED = "_mp_whole_forward"


@dataclass
class StageOutput(ModelOutput):
    """What a pipeline stage other than the last returns: the batch's loss (the last stage's value,
    back-propagating through this stage), or None when the model computed none."""

    loss: torch.Tensor | None = None


def check(model: nn.Module, virtual: int) -> None:
    """Refuse, before any collective, what a whole-model call cannot pipeline.

    Raises:
        NotImplementedError: for virtual stages, or weights tied across stages (naming them).
    """
    if virtual > 1:
        raise NotImplementedError(f"transform with pipeline_virtual_stages {virtual} (virtual stages run through "
                                  "smp.DistributedModel and @smp.step)")
    tied = [g for g in tie_groups(model.named_parameters(remove_duplicate=False)) if len(g) > 1]
    if tied:
        raise NotImplementedError(f"transform at pipeline_parallel_degree > 1 of {type(model).__name__} with weights "
                                  f"tied across stages ({', '.join(' = '.join(g) for g in tied)}); build it with "
                                  "tie_word_embeddings=False, or use smp.DistributedModel and @smp.step")


@dataclass(frozen=True)
class Link:
    """This rank's neighbours in its pipeline group (global ranks, None at the ends)."""

    group: dist.ProcessGroup
    prev: int | None
    next: int | None
    last: int
    device: torch.device

    def send(self, x: torch.Tensor, to: int) -> None:
        """``x`` with a header saying its dtype and shape (the receiver allocates from it)."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
        header[2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        dist.send(header.to(self.device), dst=to, group=self.group)
        dist.send(x.detach().contiguous(), dst=to, group=self.group)

    def receive(self, source: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=source, group=self.group)
        code, ndim, *shape = header.tolist()
        x = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=self.device)
        dist.recv(x, src=source, group=self.group)
        return x


class _Received(torch.autograd.Function):
    """The previous stage's activation; its backward sends the activation's gradient back."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link = link
        return link.receive(link.prev)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.link.send(grad, ctx.link.prev)
        return None, None


class _Sent(torch.autograd.Function):
    """A non-last stage's loss: ``value`` forward; backward receives the gradient of the
    activation this stage sent, from the next stage."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, value: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link = link
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.link.receive(ctx.link.next), None, None


def _whole(hidden: torch.Tensor, index: int) -> torch.Tensor:
    """The activation to send: a plain tensor (a replicated DTensor as its local copy)."""
    if isinstance(hidden, DTensor):
        if not all(isinstance(p, Replicate) for p in hidden.placements):
            raise RuntimeError(f"pipeline rank {index}'s output is sharded ({hidden.placements}); a stage sends a "
                               "whole activation")
        hidden = hidden.to_local()
    return hidden


def _loss_value(loss: torch.Tensor | None, link: Link, is_last: bool) -> torch.Tensor | None:
    """The last stage's loss on every stage of the pipeline (None where it computed none)."""
    box = torch.zeros(3, dtype=torch.float64, device=link.device)  # computed, value, dtype
    if is_last and loss is not None:
        box[0], box[1], box[2] = 1, loss.detach().to(torch.float64), _DTYPES.index(loss.dtype)
    dist.broadcast(box, src=link.last, group=link.group)
    if box[0].item() == 0:
        return None
    return box[1].to(_DTYPES[int(box[2].item())])


class Forward:
    """The model's forward, one batch through every stage (the module docstring); installed as
    the model's ``forward`` by ``install``."""

    def __init__(self, model: nn.Module, stage: Stage, link: Link):
        self.model, self.stage, self.link = model, stage, link
        self.original = model.forward
        self.signature = inspect.signature(self.original)

    def __call__(self, *args, **kwargs):
        stage, link = self.stage, self.link
        if stage.is_first:
            hidden = _whole(self._base(args, kwargs)[0], stage.index)
        else:
            anchor = torch.empty(0, device=link.device, requires_grad=torch.is_grad_enabled())
            with self._entering(_Received.apply(anchor, link)):
                if stage.is_last:
                    return self.original(*args, **kwargs)  # the loss reaches the others in ``finish``
                hidden = _whole(self._base(args, kwargs)[0], stage.index)
        link.send(hidden, link.next)
        value = _loss_value(None, link, False)
        if value is None:
            return StageOutput()
        if not hidden.requires_grad:
            return StageOutput(loss=value)
        return StageOutput(loss=_Sent.apply(hidden, value, link))

    @contextmanager
    def _entering(self, activation: torch.Tensor) -> Iterator[None]:
        """While inside, the stage's first block gets ``activation`` as its hidden states. The
        hook sits on the block list's entry as it is now (the block, or whatever the script wrapped
        it in: an activation checkpoint, an FSDP unit), so a checkpoint saves, and recomputes
        from, the received activation."""
        entry = self.stage.block_list._modules[str(self.stage.ranges[self.stage.index][0])]
        pending = [activation]

        def enter(module, args, kwargs):
            if not pending:
                raise RuntimeError(f"pipeline stage {self.stage.index}: its first block ran twice in one call")
            x = pending.pop()
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        handle = entry.register_forward_pre_hook(enter, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def finish(self, module, args, output):
        """The last stage's forward hook, run after the hooks that compute the loss (the
        vocabulary-parallel one): every stage gets the loss's value."""
        _loss_value(getattr(output, "loss", None), self.link, True)

    def _base(self, args: tuple, kwargs: dict):
        """The base model's output on the call's arguments (the head's own arguments dropped)."""
        bound = self.signature.bind_partial(*args, **kwargs)
        named = dict(bound.arguments)
        extra = [n for n, v in self.signature.parameters.items() if v.kind is inspect.Parameter.VAR_KEYWORD]
        for name in extra:
            named.update(named.pop(name, {}))
        for key in _HEAD_ONLY:
            named.pop(key, None)
        return self.model.base_model(**named)


def install(model: nn.Module, link: Link) -> None:
    """Make ``model``'s forward run one batch through the pipeline (once per model): the final
    modules of later stages pass their input through on this stage."""
    if _INSTALLED in model.__dict__:
        return
    stage: Stage = model._mp_stage
    for module in model.base_model.modules():
        if isinstance(module, Elsewhere) and module.kind == "final":
            module.kind = "pass"
    model.forward = model.__dict__[_INSTALLED] = forward = Forward(model, stage, link)
    if stage.is_last:
        model.register_forward_hook(forward.finish)


def link_of(group: dist.ProcessGroup, device: torch.device) -> Link:
    """This rank's neighbours in ``group`` (the pipeline group, one rank per stage, in order)."""
    ranks = dist.get_process_group_ranks(group)
    i = ranks.index(dist.get_rank())
    return Link(group, ranks[i - 1] if i > 0 else None, ranks[i + 1] if i + 1 < len(ranks) else None,
                ranks[-1], device)
