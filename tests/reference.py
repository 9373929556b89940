"""Helpers for comparing a distributed model with the single-process Hugging Face model.

The reference is always an untouched HF model built from the same config and seed; distributed
tensors are gathered (``full_tensor``) and reshaped to HF's layout only where the plan stores a
packed weight with an explicit chunk dimension (same elements, same order).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import modelparallel as smp


def gathered(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is cut into pieces across ranks (a DTensor with a placement other than
    ``Replicate()``); a parameter kept whole is a ``Replicate()`` DTensor in a model where others
    are sharded, so ``isinstance(t, DTensor)`` does not say it."""
    return isinstance(t, DTensor) and not all(pl.is_replicate() for pl in t.placements)


def as_hf(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` gathered and viewed in ``like``'s shape (packed [in, 3, out/3] -> HF [in, out])."""
    t = gathered(t)
    assert t.numel() == like.numel(), f"{tuple(t.shape)} vs {tuple(like.shape)}"
    return t.reshape(like.shape)


def build_pair(cls, config, tp: int, seed: int = 0):
    """(reference HF model, DistributedModel of an identical copy) at TP degree ``tp``."""
    # the tests give every rank the same batch: SageMaker's prescaled-batch layout (with labels,
    # logits stay vocab-sharded over the batch the TP group computed on)
    smp.init({"tensor_parallel_degree": tp, "random_seed": seed, "prescaled_batch": True})
    torch.manual_seed(seed)
    ref = cls(config)
    dist_model = smp.DistributedModel(copy.deepcopy(ref))
    return ref, dist_model


# ---- tolerances --------------------------------------------------------------------------------
# A tensor-parallel model computes the same sums as the single-process one, split over ranks and
# added in another order (and a CPU's kernels pick their own order per thread count and
# instruction set). Reordering a floating-point sum of n terms changes it by rounding only: each
# addition errs by at most eps/2 of its partial sum, and the errors of a long sum add like a random
# walk, so the difference is about sqrt(n) * eps * (magnitude of the terms). The tests' models are
# tiny: no reduction feeding a compared value, forward or backward (hidden and intermediate sizes,
# batch x sequence, the vocabulary of the loss), exceeds MAX_TERMS terms. The magnitude is taken as
# the largest entry of the expected tensor, so a near-zero entry that results from cancelling
# terms (a bias gradient summed over tokens) is judged on the tensor's scale, not its own.
# DEPTH allows for rounding carried through the layers before the compared value (each layer
# rounds anew; the tests' models have at most 6, the real MiniLM), so no single test's outcome
# sets the number.

MAX_TERMS = 4096
DEPTH = 8


def tolerance(expected: torch.Tensor, terms: int = MAX_TERMS) -> float:
    """Absolute tolerance for another evaluation of ``expected``'s computation in its dtype."""
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    eps = torch.finfo(expected.dtype).eps
    return DEPTH * math.sqrt(terms) * eps * max(scale, torch.finfo(expected.dtype).tiny)


def assert_close(actual, expected, what="", terms: int = MAX_TERMS):
    """``actual`` (gathered if distributed) equals ``expected`` up to reordered rounding."""
    torch.testing.assert_close(gathered(actual), expected, rtol=0, atol=tolerance(expected, terms),
                               msg=lambda m: f"{what}: {m}")


def assert_grads_match(ref, dist_model, rerun=None):
    """Every parameter's gathered gradient equals HF's.

    Some gradients are zero in exact arithmetic (a key bias under softmax, which ignores a
    constant added to every score): what both models hold there is rounding noise, not a sum
    whose size says anything. Given ``rerun(model) -> loss``, which computes the reference's loss
    again on the model it is given, an fp64 twin of ``ref`` measures how far the fp32
    reference's gradients are from exact, and the tolerance allows NOISE_FACTOR times that on
    top of the rule above (two fp32 evaluations each that close to exact differ by at most
    twice it; the factor 4 leaves room for the other one rounding more).
    """
    _assert_module_grads_match(ref, dist_model.module, rerun)


def _assert_module_grads_match(ref, module, rerun=None):
    """``assert_grads_match`` on a parallelized module whose parameter names are HF's."""
    ref_params = dict(ref.named_parameters())
    noise = _fp32_gradient_noise(ref, rerun) if rerun is not None else {}
    for name, p in module.named_parameters():
        expected = ref_params[name].grad
        assert p.grad is not None, f"{name}: no gradient"
        atol = tolerance(expected) + NOISE_FACTOR * noise.get(name, 0.0)
        torch.testing.assert_close(as_hf(p.grad, expected), expected, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"grad {n}: {m}")


NOISE_FACTOR = 4


def _fp32_gradient_noise(ref, rerun) -> dict[str, float]:
    """Per parameter, the largest distance of ``ref``'s fp32 gradient from an fp64 recomputation."""
    twin = copy.deepcopy(ref).double()
    twin.zero_grad(set_to_none=True)
    rerun(twin).backward()
    exact = dict(twin.named_parameters())
    noise = {}
    for name, p in ref.named_parameters():
        twin_grad = exact[name].grad
        if p.grad is not None and twin_grad is not None and torch.isfinite(twin_grad).all():
            noise[name] = (p.grad.double() - twin_grad).abs().max().item()
    return noise  # a twin whose fp64 run is not finite (masks built for fp32) measures nothing


def assert_grads_on_model_scale(ref, dist_model):
    """Every gathered gradient equals the reference's within the tolerance of the model's largest
    gradient: for small hand-built models whose gradients (a bias summed over positions) cancel
    to far below the scale of the terms that produced them. Returns that tolerance."""
    ref_params = dict(ref.named_parameters())
    grad_tol = max(tolerance(p.grad) for p in ref.parameters())
    for name, p in dist_model.module.named_parameters():
        torch.testing.assert_close(gathered(p.grad), ref_params[name].grad, rtol=0, atol=grad_tol, msg=name)
    return grad_tol


def training_rtol(step: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance of the loss after ``step`` optimizer steps of two runs that round
    differently: each step's update carries the previous steps' rounding differences into the
    weights (roughly linear growth over a few steps), on top of the step's own. It bounds
    rounding only: under AdamW, whose update barely changes when every gradient is scaled by one
    factor, a loss within it does not show a gradient average off by a constant factor."""
    return (step + 1) * DEPTH * math.sqrt(MAX_TERMS) * torch.finfo(dtype).eps


def assert_same_training(ref, dist_model, batches, lr=1e-3, what=""):
    """AdamW on the reference and on the distributed model, batch by batch (each batch a dict of
    forward kwargs with labels): every step's loss agrees within ``training_rtol``."""
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = torch.optim.AdamW(dist_model.parameters(), lr=lr)
    for step, kwargs in enumerate(batches):
        loss_ref = ref(**kwargs).loss
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = dist_model(**kwargs).loss
        dist_model.backward(loss)
        opt.step()
        opt.zero_grad()
        rel = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
        assert rel < training_rtol(step), \
            f"{what}step {step}: loss {loss.item()} vs HF {loss_ref.item()} (rel {rel:.2e})"


def _has_fsdp1(module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def token_batches(vocab: int, steps: int, rows: int = 4, seq: int = 10) -> list[torch.Tensor]:
    """``steps`` fixed batches of token ids in ``[1, vocab)``, ``rows`` x ``seq`` each."""
    g = torch.Generator().manual_seed(4)
    return [torch.randint(1, vocab, (rows, seq), generator=g) for _ in range(steps)]


def assert_replicas_train_like_one_process(ref, model, batches, after_backward=None, lr=1e-3, compare_grads=True):
    """Data-parallel training against one process on the whole batch, step by step.

    Each data-parallel replica of ``model`` (every TP rank of it alike) trains on its contiguous
    share of each batch's rows; ``ref`` trains on all of them. Equal-length rows make the mean of
    the replicas' mean losses the whole batch's mean loss, so gradients averaged over the replicas
    equal the reference's up to rounding, and so does every step's loss. The first step's
    gradients are compared too: AdamW's update hardly changes when every gradient is scaled by
    the same factor, so a wrong average (summed instead of averaged, or the average applied
    twice) would leave the losses within rounding of the reference's.

    Args:
        ref: single-process model, trained with AdamW at ``lr``.
        model: a ``DistributedModel`` (backward through it, AdamW in a ``DistributedOptimizer``)
            or a module the caller parallelized itself (plain ``loss.backward()`` and AdamW).
        batches: token-id tensors whose row count divides by the number of replicas.
        after_backward: ``after_backward(step)``, called once both models hold the step's
            gradients and before either optimizer steps (extra checks, a manual gradient average).
        compare_grads: compare the first step's gradients (after ``after_backward``) with the
            reference's by parameter name; off where ``after_backward`` clips (the fp64 rerun
            measuring rounding noise does not clip). A model holding FSDP1 units is never
            compared this way (its parameters are flat shards with no HF name): losses only.

    Raises:
        AssertionError: a first-step gradient differs from the reference's beyond
            ``assert_grads_match``'s tolerance, or a step's mean loss over the replicas differs
            from the reference's by more than ``training_rtol(step)`` relative.
    """
    distributed = isinstance(model, smp.DistributedModel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    optimizer = smp.DistributedOptimizer(optimizer) if distributed else optimizer
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    rank, replicas = smp.rdp_rank(), smp.rdp_size()
    for step, ids in enumerate(batches):
        want = ref(ids, labels=ids).loss
        want.backward()
        mine = ids[rank * len(ids) // replicas:(rank + 1) * len(ids) // replicas]
        loss = model(mine, labels=mine).loss
        if distributed:
            model.backward(loss)
        else:
            loss.backward()
        if after_backward is not None:
            after_backward(step)
        module = model.module if distributed else model
        if step == 0 and compare_grads and not _has_fsdp1(module):
            _assert_module_grads_match(ref, module, rerun=lambda twin: twin(ids, labels=ids).loss)
        for opt in (opt_ref, optimizer):
            opt.step()
            opt.zero_grad()
        mean = gathered(loss.detach()).clone()
        dist.all_reduce(mean, group=smp.get_rdp_process_group())
        mean /= replicas
        rel = abs(mean.item() - want.item()) / abs(want.item())
        assert rel < training_rtol(step), \
            f"step {step}: loss {mean.item()} vs single process {want.item()} (rel {rel:.1e})"


def comm_counts_by_kind(mode) -> dict[str, int]:
    """``CommDebugMode`` counts merged by collective kind (``all_reduce``, ``allreduce``...)."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        kind = str(op).split(".")[-1].rstrip("_'>) ")
        counts[kind] = counts.get(kind, 0) + n
    return counts


def all_reduces(counts: dict[str, int]) -> int:
    """All-reduces in ``comm_counts_by_kind`` counts, functional (out of place) and c10d (in
    place) alike: which of the two a layer uses is an implementation choice, the count is not."""
    return counts.get("all_reduce", 0) + counts.get("allreduce", 0)


def context_replicas_train_like_one_process(ref, opt_ref, model, optimizer, backward, batches, grads_of=None) -> None:
    """Each data-parallel replica trains on its rows of every batch, each context rank on its part
    of them (``smp.get_batch_for_cp_rank``); the mean of the data x context ranks' loss shares must
    be one process's loss on the whole batch, step by step (``ref`` stepping with ``opt_ref``);
    with ``grads_of`` (the parallelized module) every first-step gradient equals one process's."""
    from modelparallel import runtime

    replicas, rank = smp.rdp_size(), smp.rdp_rank()
    everyone = runtime.current().group(runtime.DP_CP_GROUP)
    for step, ids in enumerate(batches):
        want = ref(ids, labels=ids).loss
        want.backward()
        rows = ids.shape[0]
        mine = smp.get_batch_for_cp_rank(ids[rank * rows // replicas:(rank + 1) * rows // replicas])
        loss = model(input_ids=mine, labels=mine).loss
        backward(loss)
        if step == 0 and grads_of is not None:
            _assert_module_grads_match(ref, grads_of, rerun=lambda twin: twin(ids, labels=ids).loss)
        for opt in (opt_ref, optimizer):
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=everyone)
        mean = mean.item() / (replicas * smp.cp_size())
        rel = abs(mean - want.item()) / abs(want.item())
        assert rel < training_rtol(step), f"step {step}: loss {mean} vs one process {want.item()} (rel {rel:.1e})"


def count_block_runs(module) -> dict[str, int]:
    """Per block, how many times the inside of its checkpointed region runs (a forward and, when
    checkpointing is on, a recompute: counted at each block's ``input_layernorm``)."""
    runs = {}
    for name, m in module.named_modules():
        if name.endswith("input_layernorm"):
            runs[name] = 0
            m.register_forward_pre_hook(lambda *_, n=name: runs.__setitem__(n, runs[n] + 1))
    return runs


def checkpointed_alike(ref, make, when: str, wrap):
    """The model ``make`` builds from a copy of ``ref``, with ``ref`` and it checkpointed the same
    way. ``when``: "before" (``wrap``, PyTorch's wrappers, put on ``ref`` before ``make``: the
    model starts wrapped), "after" (``wrap`` on both after ``make``), "hf" (Hugging Face's
    ``gradient_checkpointing_enable`` on both after it). Checks the model's decoder blocks are
    wrapped exactly when PyTorch's wrappers were used."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if when == "before":
        wrap(ref)
    model = make(copy.deepcopy(ref))
    if when == "after":
        wrap(ref)
        wrap(model)
    elif when == "hf":
        for m in (ref, model):
            m.gradient_checkpointing_enable()
    wrapped = when != "hf"
    assert all((type(m) is CheckpointWrapper) == wrapped for m in model.model.layers), list(model.model.layers)
    return model

