"""What a context-parallel model does with its inputs before Hugging Face's forward runs.

Each rank passes its part of the batch (``layout.split``: input_ids and labels [B, S/C]). Before
the forward:

1. Every rank checks its inputs, then the ranks of the context-parallel group compare what they
   found in one small all-gather, so a problem on one rank (padding in its chunks only) stops
   every rank with the same error instead of leaving the others waiting in attention.
2. ``position_ids``, when the caller gives none, become the tokens' global positions, so rotary
   and learned position embeddings see the whole-sequence positions. HF's forward numbers the
   tokens 0..S-1 whatever the padding (GPT-2, Llama, BERT alike; only ``generate`` derives
   positions from the mask), so padded batches get the same.
3. ``attention_mask`` (a [B, L] padding mask, left or right padding alike) becomes the whole
   sequences' [B, S] bool mask, gathered once: attention masks each key chunk's padding with it
   (``attention``); None when nothing is padded.
4. ``labels`` become ``shift_labels``: the label of each local token's successor in the whole
   sequence, found by gathering the labels (small integers) once. The successor of a chunk's
   last token sits in another chunk, maybe on another rank; this way no target is dropped or
   counted twice. ``num_items_in_batch`` becomes the whole sequences' target count over C, so
   each rank returns its share of the loss: the mean over the group of the ranks' losses is one
   process's loss on the whole sequences, and so are the averaged gradients. An encoder's labels
   (masked-LM, token classification) belong to their own positions: nothing is shifted, only the
   count is global, and ``token_loss`` divides this rank's summed loss by that share (HF's
   encoder heads take the mean over the rank's own tokens, which the share replaces).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..compat import all_gather_single
from . import decode
from .attention import Ring
from .layout import merge, positions
from .spec import ContextSpec

IGNORE_INDEX = -100

# One small int64 header per rank: (problem code, detail, batch, local length).
OK, NO_TOKENS, ODD_LENGTH, MASK_SHAPE, LABEL_SHAPE, MASK_DIMS = range(6)
_PROBLEMS = {
    NO_TOKENS: (ValueError, "neither input_ids nor inputs_embeds was given"),
    ODD_LENGTH: (ValueError, "its sequence part has {L} tokens, an odd number: each context-parallel rank holds "
                             "two equal chunks, so the whole sequence must divide by 2 x context_parallel_degree"),
    MASK_SHAPE: (ValueError, "its attention_mask has {detail} tokens per row where its inputs have {L}"),
    MASK_DIMS: (NotImplementedError, "its attention_mask has {detail} dimensions; under context parallelism "
                                     "only a 2-D [batch, tokens] padding mask is implemented"),
    LABEL_SHAPE: (ValueError, "its labels have {detail} tokens per row where its inputs have {L}"),
}


def as_kwargs(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (positional ones bound to ``module.forward``'s parameters)."""
    if not args:
        return dict(kwargs)
    bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    var = next((p.name for p in inspect.signature(module.forward).parameters.values()
                if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    out = {k: v for k, v in bound.items() if k != var}
    out.update(bound.get(var, {}))
    return out


def _tokens(kw: dict) -> torch.Tensor | None:
    ids = kw.get("input_ids")
    return ids if ids is not None else kw.get("inputs_embeds")


def _local_problem(kw: dict) -> tuple[int, int]:
    """(problem code, detail) of this rank's inputs."""
    tokens = _tokens(kw)
    if tokens is None:
        return NO_TOKENS, 0
    if tokens.shape[1] % 2:
        return ODD_LENGTH, 0
    mask = kw.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return MASK_DIMS, mask.dim()
    if mask is not None and mask.shape[-1] != tokens.shape[1]:
        return MASK_SHAPE, mask.shape[-1]
    labels = kw.get("labels")
    if labels is not None and labels.shape[-1] != tokens.shape[1]:
        return LABEL_SHAPE, labels.shape[-1]
    return OK, 0


def agree(ring: Ring, kw: dict) -> None:
    """Check this rank's inputs and learn every other rank's verdict (one all-gather).

    Raises:
        ValueError or NotImplementedError: on every rank of the group alike, naming each rank's
            problem, or the ranks' disagreeing shapes.
    """
    code, detail = _local_problem(kw)
    tokens = _tokens(kw)
    shape = tuple(tokens.shape[:2]) if tokens is not None else (0, 0)
    header = torch.tensor([code, detail, *shape], dtype=torch.int64, device=_device(kw))
    everyone = header.new_empty(ring.size * 4)
    all_gather_single(everyone, header, group=ring.group)
    rows = everyone.view(ring.size, 4).tolist()
    lines, kinds = [], set()
    for rank, (code, detail, batch, length) in enumerate(rows):
        if code != OK:
            kind, text = _PROBLEMS[code]
            kinds.add(kind)
            lines.append(f"context-parallel rank {rank}: " + text.format(L=length, detail=detail))
    if not lines and len({(b, n) for _, _, b, n in rows}) > 1:
        kinds.add(ValueError)
        lines = [f"the context-parallel ranks were given different shapes (batch x tokens): "
                 + ", ".join(f"rank {r} {b} x {n}" for r, (_, _, b, n) in enumerate(rows))
                 + "; each must pass its part of the same sequences (smp.get_batch_for_cp_rank)"]
    if lines:
        error = NotImplementedError if kinds == {NotImplementedError} else ValueError
        raise error("context parallelism cannot run this batch:\n  - " + "\n  - ".join(lines))


def _device(kw: dict) -> torch.device:
    tokens = _tokens(kw)
    return tokens.device if tokens is not None else torch.device("cpu")


def _gather_tokens(ring: Ring, local: torch.Tensor) -> torch.Tensor:
    """The whole sequences of a [B, L] tensor every rank holds its part of: [B, C x L]."""
    local = local.contiguous()
    everyone = local.new_empty((ring.size * local.shape[0],) + local.shape[1:])
    all_gather_single(everyone, local, group=ring.group)
    return merge(list(everyone.chunk(ring.size)), seq_dim=1)


def _shift(ring: Ring, kw: dict, where: torch.Tensor) -> None:
    """``labels`` -> ``shift_labels`` of the local tokens, and this rank's ``num_items_in_batch``."""
    ignore = kw.get("ignore_index", IGNORE_INDEX)
    if kw.get("shift_labels") is not None:  # already shifted by the caller: only the count is global
        whole = _gather_tokens(ring, kw["shift_labels"])
        count = (whole != ignore).sum()
    else:
        whole = _gather_tokens(ring, kw["labels"])
        shifted = F.pad(whole[..., 1:], (0, 1), value=ignore)
        kw["shift_labels"] = shifted[..., where]
        count = (shifted != ignore).sum()
    given = kw.get("num_items_in_batch")
    kw["num_items_in_batch"] = (given if given is not None else count) / ring.size


def _count(ring: Ring, kw: dict) -> None:
    """An encoder's ``num_items_in_batch``: the whole sequences' labelled tokens over C (labels
    stay where they are)."""
    ignore = kw.get("ignore_index", IGNORE_INDEX)
    given = kw.get("num_items_in_batch")
    count = given if given is not None else (_gather_tokens(ring, kw["labels"]) != ignore).sum()
    kw["num_items_in_batch"] = count / ring.size


def token_loss(module: nn.Module, args: tuple, kwargs: dict, output):
    """An encoder's forward hook: this rank's share of a per-token loss (labels at their own
    positions), the summed cross-entropy of its tokens over ``num_items_in_batch``. Logits left
    vocab-sharded (a DTensor) mean tensor parallelism computed the loss already, with that share."""
    labels, logits = kwargs.get("labels"), getattr(output, "logits", None)
    if labels is None or logits is None or isinstance(logits, DTensor) or getattr(output, "loss", None) is None:
        return output
    ignore = kwargs.get("ignore_index", IGNORE_INDEX)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                           ignore_index=ignore, reduction="sum") / kwargs["num_items_in_batch"]
    return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})


def _positions(ring: Ring, spec: ContextSpec, module: nn.Module, kw: dict, where: torch.Tensor) -> torch.Tensor:
    """The local tokens' position ids as HF's forward computes them for the whole sequences."""
    if spec.positions is None:
        return where.unsqueeze(0)
    ids = kw.get("input_ids")
    whole = _gather_tokens(ring, ids) if ids is not None else None
    return spec.positions(module.config, whole, where.numel() * ring.size).to(where.device)[:, where]


def _whole_mask(ring: Ring, mask: torch.Tensor) -> torch.Tensor | None:
    """The whole sequences' [B, S] bool padding mask from every rank's [B, L] part; None when no
    token is padded (every rank finds the same)."""
    whole = _gather_tokens(ring, mask.ne(0).to(torch.uint8)).bool()
    return None if bool(whole.all()) else whole


def prepare(ring: Ring, spec: ContextSpec, causal: bool, module: nn.Module, args: tuple,
            kwargs: dict) -> tuple[tuple, dict]:
    """The forward pre-hook of a context-parallel model (see the module doc): check, then global
    positions, the whole padding mask, the labels (shifted when ``causal``) and the loss share;
    with a key/value cache, ``generate``'s steps (``decode``)."""
    kw = as_kwargs(module, args, kwargs)
    if kw.get("past_key_values") is not None:  # generate(): the whole prompt, then decode steps
        if decode.prepare(ring, kw) and kw.get("position_ids") is None:
            length = _tokens(kw).shape[1]
            kw["position_ids"] = positions(length, ring.size, ring.rank, device=_device(kw)).unsqueeze(0)
        return (), kw
    agree(ring, kw)
    length = _tokens(kw).shape[1]
    where = positions(length, ring.size, ring.rank, device=_device(kw))
    if kw.get("position_ids") is None:
        kw["position_ids"] = _positions(ring, spec, module, kw, where)
    if kw.get("attention_mask") is not None:
        kw["attention_mask"] = _whole_mask(ring, kw["attention_mask"])
    if kw.get("labels") is not None:
        _shift(ring, kw, where) if causal else _count(ring, kw)
    kw["use_cache"] = False
    return (), kw
