"""Helpers for comparing a distributed model with the single-process Hugging Face model.

The reference is always an untouched HF model built from the same config and seed; distributed
tensors are gathered (``full_tensor``) and reshaped to HF's layout only where the plan stores a
packed weight with an explicit chunk dimension (same elements, same order).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

import modelparallel as smp


def gathered(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def as_hf(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` gathered and viewed in ``like``'s shape (packed [in, 3, out/3] -> HF [in, out])."""
    t = gathered(t)
    assert t.numel() == like.numel(), f"{tuple(t.shape)} vs {tuple(like.shape)}"
    return t.reshape(like.shape)


def build_pair(cls, config, tp: int, seed: int = 0):
    """(reference HF model, DistributedModel of an identical copy) at TP degree ``tp``."""
    smp.init({"tensor_parallel_degree": tp, "random_seed": seed})
    torch.manual_seed(seed)
    ref = cls(config)
    dist_model = smp.DistributedModel(copy.deepcopy(ref))
    return ref, dist_model


def assert_close(actual, expected, rtol=1e-5, atol=1e-5, what=""):
    torch.testing.assert_close(gathered(actual), expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_grads_match(ref, dist_model, rtol=1e-4, atol=1e-5):
    """Every parameter's gathered gradient equals HF's."""
    ref_params = dict(ref.named_parameters())
    for name, p in dist_model.module.named_parameters():
        expected = ref_params[name].grad
        assert p.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(as_hf(p.grad, expected), expected, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"grad {n}: {m}")


def assert_same_training(ref, dist_model, batches, lr=1e-3, rtol=1e-4, what=""):
    """AdamW on the reference and on the distributed model, batch by batch (each batch a dict of
    forward kwargs with labels): every step's loss agrees within ``rtol`` (relative)."""
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
        assert rel < rtol, f"{what}step {step}: loss {loss.item()} vs HF {loss_ref.item()} (rel {rel:.2e})"


def comm_counts_by_kind(mode) -> dict[str, int]:
    """``CommDebugMode`` counts merged by collective kind (``all_reduce``, ``allreduce``...)."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        kind = str(op).split(".")[-1].rstrip("_'>) ")
        counts[kind] = counts.get(kind, 0) + n
    return counts
