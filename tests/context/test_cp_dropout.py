"""Attention dropout under context parallelism.

Its draws cannot equal one process's ``nn.functional.dropout`` (another generator, another
layout), so what is tested is the semantics: softmax over the whole row, then each probability
kept with probability 1 - p and scaled by 1 / (1 - p), with a mask that is a function of the seed
and the element's global coordinates (``context/dropout.py``). Given that mask, everything
around it is exact:

- the ring's and the all-gather's blocks, merged by the log-sum-exp of the undropped scores and
  differentiated against the merged (dropped) output, equal plain autograd of
  softmax-dropout-matmul on the whole sequence, outputs and q/k/v gradients, causal and
  bidirectional, with padding, at 2 and 4 ranks;
- a GPT-2 and a Llama model trained under context parallelism equal one HF process whose attention
  function applies the same masks (seeds drawn from the same generator state): logits, loss,
  every gradient;
- the mask keeps 1 - p of the elements (binomial bounds), p = 0 is the undropped attention, the
  same seed repeats a run and another seed changes it.

Where to look: a kernel mismatch -> blocks.py ``_math_backward`` with ``drop`` or attention.py
``_drop`` (the block's global positions); model-level only -> context/hf.py passing HF's
``dropout``; statistics -> dropout.py's hash.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from transformers import AttentionInterface, AttentionMaskInterface, GPT2Config, GPT2LMHeadModel, LlamaConfig, \
    LlamaForCausalLM
from transformers.masking_utils import eager_mask

import harness
import modelparallel as smp
from modelparallel.context.attention import Ring, context_attention
from modelparallel.context.dropout import draw_seed, keep_scale
from modelparallel.context.layout import split
from reference import _assert_module_grads_match, assert_close
from test_attention import _gathered
from test_models import average_grads, cp_mean, full_logits

P = 0.3


def _whole(q, k, v, causal, keys, p, seed, scale):
    """Softmax over the whole row, then the dropout mask of ``keep_scale``, then the values."""
    n = q.shape[2]
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    seen = keys[:, None, None, :].expand(-1, 1, n, -1)
    if causal:
        seen = seen & torch.ones(n, n, dtype=torch.bool).tril()
    probs = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    if p:
        probs = probs * keep_scale(seed, p, q.shape[0], heads, torch.arange(n), torch.arange(n), n)
    return torch.matmul(probs, v)


def check_kernel(comm: str, causal: bool, p: float):
    size, rank = dist.get_world_size(), dist.get_rank()
    ring = Ring(dist.group.WORLD, rank, size, comm)
    g = torch.Generator().manual_seed(11)
    n, scale, seed = 4 * size * 2, 1 / math.sqrt(8), 987654321
    q = torch.randn(2, 4, n, 8, generator=g)
    k, v = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
    dout = torch.randn(2, 4, n, 8, generator=g)
    keys = torch.ones(2, n, dtype=torch.bool)
    keys[1, n - 5:] = False  # right padding across a chunk boundary: every query sees a key
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _whole(*full, causal, keys, p, seed, scale)
    want.backward(dout)
    mine = [split(t, size, rank, seq_dim=2).requires_grad_() for t in (q, k, v)]
    out = context_attention(*mine, ring, scale, causal=causal, keys=keys, dropout=p, seed=seed)
    out.backward(split(dout, size, rank, seq_dim=2))
    assert_close(_gathered(out.detach()), want.detach(), f"{comm} output", terms=n)
    for name, got, ref in zip("qkv", mine, full):
        assert_close(_gathered(got.grad), ref.grad, f"{comm} d{name}", terms=n)


@pytest.mark.parametrize("world, comm, causal, p", [(2, "p2p", True, P), (2, "all_gather", True, P),
                                                    (2, "p2p", False, P), (4, "p2p", True, P),
                                                    (4, "all_gather", False, P), (2, "p2p", True, 0.0)])
def test_blocks_with_dropout_equal_whole_attention(world, comm, causal, p):
    harness.run(world, check_kernel, comm, causal, p)


def test_mask_statistics():
    """Kept fraction within 5 standard deviations of 1 - p; seeds give unrelated masks."""
    n, trials = 64, 2 * 4 * 64 * 64
    pos = torch.arange(n)
    one, other = (keep_scale(s, P, 2, 4, pos, pos, n) for s in (5, 6))
    bound = 5 * math.sqrt(P * (1 - P) / trials)
    assert abs((one > 0).float().mean().item() - (1 - P)) < bound
    assert set(one.unique().tolist()) == {0.0, torch.tensor(1 / (1 - P)).item()}
    agree = ((one > 0) == (other > 0)).float().mean().item()  # independent: (1-p)^2 + p^2
    assert abs(agree - ((1 - P) ** 2 + P ** 2)) < 5 * math.sqrt(0.25 / trials)
    assert torch.equal(one, keep_scale(5, P, 2, 4, pos, pos, n))
    assert torch.equal(one[:, :, 8:16, 40:48], keep_scale(5, P, 2, 4, pos[8:16], pos[40:48], n))


REFERENCE = "cp_test_reference_dropout"


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One process's attention with context parallelism's dropout masks (the seed drawn as
    ``context_attention`` draws it): HF's eager attention otherwise."""
    heads, n = query.shape[1], query.shape[2]
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    s = torch.matmul(query, key.transpose(-1, -2)) * scaling + attention_mask
    probs = torch.softmax(s, dim=-1)
    if dropout:
        probs = probs * keep_scale(draw_seed(), dropout, query.shape[0], heads, torch.arange(n), torch.arange(n), n)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _model(arch: str):
    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=P))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                        attention_dropout=P))


def check_model(arch: str, comm: str):
    smp.init({"context_parallel_degree": 2})
    AttentionInterface.register(REFERENCE, _reference_attention)
    AttentionMaskInterface.register(REFERENCE, eager_mask)
    ref = _model(arch)
    model = smp.transform(copy.deepcopy(ref), cp_comm_type=comm)
    ref.config._attn_implementation = REFERENCE
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(21)
    want = ref(ids, labels=ids)
    local = smp.get_batch_for_cp_rank(ids)
    torch.manual_seed(21)
    got = model(input_ids=local, labels=local)
    assert_close(full_logits(got.logits), want.logits, f"{arch} logits with dropout", terms=16)
    assert_close(cp_mean(got.loss), want.loss, f"{arch} loss with dropout")
    want.loss.backward()
    got.loss.backward()
    average_grads(model)
    _assert_module_grads_match(ref, model)
    torch.manual_seed(21)
    again = model(input_ids=local, labels=local).loss
    torch.manual_seed(22)
    other = model(input_ids=local, labels=local).loss
    model.eval()
    undropped = model(input_ids=local, labels=local).loss
    ref.eval()
    return again.item() == got.loss.item(), other.item() != got.loss.item(), \
        abs(cp_mean(undropped).item() - ref(ids, labels=ids).loss.item()), undropped.item() != got.loss.item()


@pytest.mark.parametrize("arch, comm", [("gpt2", "p2p"), ("llama", "all_gather")])
def test_model_with_dropout_equals_one_process_with_the_same_masks(arch, comm):
    for same, differs, eval_error, changed in harness.run(2, check_model, arch, comm):
        assert same, "the same seed did not repeat the run"
        assert differs and changed, "another seed, or no dropout, left the loss unchanged"
        assert eval_error < 1e-5, f"eval (no dropout) loss off by {eval_error}"
