"""Data-parallel gradient averaging overlapped with the backward pass (``overlapping_allreduce``,
``bucket_cap_mb``), against one Hugging Face process on the whole global batch.

A failure means modelparallel/training/dp.py (``OverlappedAverage``: buckets, launch order, the
write-back) or ``DistributedModel``'s arming of it in model_grads.py averages the wrong gradients, or
averages them after the backward instead of during it.
"""

import copy
from collections import OrderedDict

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp
from modelparallel.training.dp import OverlappedAverage
from reference import assert_grads_match

ROWS = 8


def _setup(microbatches: int, **model_args):
    smp.init({"microbatches": microbatches, "random_seed": 1})
    torch.manual_seed(1)
    ref = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    # never called, and registered first, so its bucket is the last to launch: it gets no gradient
    # and launches at the end (a bucket waiting for a gradient holds back the buckets after it)
    ref._modules = OrderedDict([("unused", nn.Linear(4, 4)), *ref._modules.items()])
    ids = torch.randint(0, 61, (ROWS, 8), generator=torch.Generator().manual_seed(0))
    ref(ids, labels=ids).loss.backward()
    model = smp.DistributedModel(copy.deepcopy(ref), **model_args)
    model.zero_grad(set_to_none=True)
    return ref, model, ids.chunk(smp.dp_size())[smp.dp_rank()]


def _match_without_unused(ref, model):
    assert model.module.unused.weight.grad is None
    del ref.unused, model.module.unused  # no gradient on either side; the rest must match
    assert_grads_match(ref, model)


def _launched_before_finish(monkeypatch_target=OverlappedAverage):
    """Record, at each ``finish``, how many buckets had already been launched by the hooks."""
    seen = []
    original = monkeypatch_target.finish

    def finish(self, apply=True):
        seen.append((len(self._launched), len(self.buckets), apply))
        return original(self, apply)
    monkeypatch_target.finish = finish
    return seen, lambda: setattr(monkeypatch_target, "finish", original)


def overlapped_plain_loop():
    """One bucket per parameter: most launch during the backward, the unused one at the end."""
    ref, model, mine = _setup(1, bucket_cap_mb=1e-6)
    seen, restore = _launched_before_finish()
    try:
        model.backward(model(mine, labels=mine).loss)
    finally:
        restore()
    _match_without_unused(ref, model)
    (launched, buckets, applied), = seen
    assert applied and 0 < launched < buckets, seen  # during the pass; the unused one's waits for finish
    return launched, buckets


def test_buckets_launch_during_backward_and_average_like_one_process():
    harness.run(2, overlapped_plain_loop)


def second_backward_in_last_microbatch():
    """Two backward calls in the last microbatch: the buckets launched during the first miss the
    second's gradients, so that step is averaged after the backward instead; still HF's gradients."""
    ref, model, mine = _setup(2, bucket_cap_mb=1e-6)

    @smp.step
    def train_step(ids):
        for _ in range(2):
            model.backward(model(ids, labels=ids).loss * 0.5)

    seen, restore = _launched_before_finish()
    try:
        train_step(mine)
    finally:
        restore()
    _match_without_unused(ref, model)
    assert [applied for _, _, applied in seen] == [False], seen  # the first launch dropped, not applied


def test_second_backward_in_the_last_microbatch_falls_back():
    harness.run(2, second_backward_in_last_microbatch)


def not_overlapped():
    ref, model, mine = _setup(1, overlapping_allreduce=False)
    seen, restore = _launched_before_finish()
    try:
        model.backward(model(mine, labels=mine).loss)
    finally:
        restore()
    _match_without_unused(ref, model)
    assert seen == [], "overlapping_allreduce=False averages after the backward"


def test_overlapping_allreduce_false_averages_after_backward():
    harness.run(2, not_overlapped)
