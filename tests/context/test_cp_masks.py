"""Padded batches under context parallelism equal one Hugging Face process on the whole padded
sequences: logits on the real tokens (gathered back), the loss (the mean of the ranks' shares) and
every gradient, for GPT-2 (learned positions) and Llama (rotary, grouped-query attention), at
C=2 and C=2 x T=2, with both communication types; Mistral (a sliding window), GPT-Neo (local
layers) and GPT-J (their own attention methods) once.

One row is left-padded across a chunk boundary (its padding queries see no key at all under causal
attention), one right-padded across two chunks, one unpadded; padding labels are -100, as
collators set them. HF's forward numbers positions 0..S-1 whatever the padding, and so does
context parallelism when no position_ids are given. A padding query that sees no key is compared
too where HF runs PyTorch's attention (its default), which gives it output 0, as ours does;
GPT-J's and GPT-Neo's own attention gives it the mean of the values instead (a row nothing reads:
its key is masked), so there only the real tokens' logits are compared, and the first real token
after left padding (predicted from the last padding query) is not labelled. Nothing is nan.

Where to look: logits wrong only on padded rows -> context/blocks.py ``block_mask`` (the key
chunk's padding) or attention.py (which key chunk a block slices); nan -> the log-sum-exp of rows
that see no key (attention.py's backward, blocks.py's merge); only with TP -> the mask reaching
the attention interface (context/hf.py ``_padding_mask``).
"""

import pytest
import torch

import harness
import modelparallel as smp
from reference import _assert_module_grads_match, assert_close
from test_models import SEQ, VOCAB, average_grads, cp_mean, full_logits, pair


OWN_ATTENTION = ("gptj", "gptneo")  # HF's eager-style _attn: a row that sees no key averages the values


def padded_batch(seed: int):
    """(ids [3, SEQ], attention_mask, labels): row 0 left-padded by 5, row 1 right-padded by 6."""
    ids = torch.randint(3, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, SEQ - 6:] = 0
    ids = ids.masked_fill(mask == 0, 0)  # the pad token
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, 7] = -100
    return ids, mask, labels


def check_padded(arch: str, cp: int, tp: int, comm: str):
    ref, model = pair(arch, {"context_parallel_degree": cp, "tensor_parallel_degree": tp}, comm)
    ids, mask, labels = padded_batch(3)
    if arch in OWN_ATTENTION:  # the last left-padding query predicts the first real token: not compared
        labels[0, 5] = -100
    want = ref(ids, attention_mask=mask, labels=labels)
    mine = smp.get_batch_for_cp_rank((ids, mask, labels))
    got = model(input_ids=mine[0], attention_mask=mine[1], labels=mine[2])
    logits = full_logits(got.logits)
    assert not logits.isnan().any(), f"{arch}: nan logits"
    real = mask.bool()
    assert_close(logits[real], want.logits[real], f"{arch} logits of real tokens", terms=SEQ)
    if arch not in OWN_ATTENTION:
        assert_close(logits, want.logits, f"{arch} logits, padding included", terms=SEQ)
    assert_close(cp_mean(got.loss), want.loss, f"{arch} loss")
    want.loss.backward()
    got.loss.backward()
    average_grads(model)
    _assert_module_grads_match(ref, model, rerun=lambda m: m(ids, attention_mask=mask, labels=labels).loss)
    unpadded = model(input_ids=mine[0], attention_mask=torch.ones_like(mine[1])).logits
    assert_close(smp.gather_sequence(unpadded), ref(ids).logits, f"{arch} all-ones mask", terms=SEQ)


CASES = [pytest.param("llama", 2, 1, "p2p", marks=pytest.mark.smoke), ("llama", 2, 1, "all_gather"),
         ("gpt2", 2, 1, "p2p"), ("gpt2", 2, 1, "all_gather"), ("mistral", 2, 1, "p2p"), ("gptneo", 2, 1, "all_gather"),
         ("gptj", 2, 1, "p2p"),
         ("llama", 2, 2, "p2p"), ("llama", 2, 2, "all_gather"), ("gpt2", 2, 2, "p2p"), ("gpt2", 2, 2, "all_gather")]


@pytest.mark.parametrize("arch, cp, tp, comm", CASES)
def test_padded_batch_equals_one_process(arch, cp, tp, comm):
    harness.run(cp * tp, check_padded, arch, cp, tp, comm)
