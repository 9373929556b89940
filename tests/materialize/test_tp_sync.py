"""Replicated parameters are TP rank 0's after wrap (materialize/tp_sync.py).

A failure means ``DistributedModel`` no longer overwrites the parameters each TP rank holds whole
with TP rank 0's values. Without the sync, ranks seeded differently before building the model (as
SageMaker's scripts do) compute different functions. (Sharded parameters are not its business: the
TP styles already cut them from one rank's tensor or from each rank's own.)
"""

import torch
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp
from modelparallel.tp.layout import local_part


def wrap_seeded_per_rank():
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(100 + smp.tp_rank())  # every TP rank builds different weights
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=61, n_positions=16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = smp.DistributedModel(model)
    return before, {n: local_part(p).detach().clone() for n, p in model.module.named_parameters()
                    if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements)}


def test_replicated_parameters_are_tp_rank0s():
    (before0, rep0), (before1, rep1) = harness.run(2, wrap_seeded_per_rank)
    assert rep0.keys() == rep1.keys() and len(rep0) >= 5, sorted(rep0)  # wpe, layer norms, row biases
    assert not torch.equal(before0["transformer.wpe.weight"], before1["transformer.wpe.weight"])  # seeds differ
    for name, value in rep0.items():
        assert torch.equal(value, before0[name]), f"{name} on TP rank 0 changed"
        assert torch.equal(rep1[name], before0[name]), f"{name} on TP rank 1 is not TP rank 0's"
