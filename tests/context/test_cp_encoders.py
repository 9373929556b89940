"""Encoders under context parallelism equal one Hugging Face process on the whole sequences:
BERT and RoBERTa masked-LM (and BERT token classification), bidirectional attention over the
sequence split in the same two-chunk layout as decoders, with padding: logits (gathered back), the
loss (the mean of the ranks' shares; labels on the masked tokens only, not shifted) and every
gradient, at C=2 with both communication types, and BERT at C=2 x T=2 (the vocab-parallel loss
taking the same share). RoBERTa counts positions from its padding id
over non-padding tokens, from the whole sequences' ids; BERT counts 0..S-1.

Where to look: logits wrong -> context/blocks.py (``pair_kind`` with ``causal`` False) or the
attention module's ``is_causal`` reaching context/hf.py; RoBERTa only -> ``positions`` in
models/roberta.py and inputs.py ``_positions``; loss only -> inputs.py ``token_loss`` and
``_count`` (the share); a refused head -> the ``heads`` of models/bert.py's ``encoder_context``.
"""

import copy

import pytest
import torch
from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification,
                          RobertaConfig, RobertaForMaskedLM)

import harness
import modelparallel as smp
from reference import _assert_module_grads_match, assert_close
from test_models import average_grads, cp_mean, full_logits

VOCAB, SEQ, PAD = 64, 16, 1
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
             max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             pad_token_id=PAD)
MODELS = {"bert": (BertForMaskedLM, BertConfig), "roberta": (RobertaForMaskedLM, RobertaConfig),
          "bert_tokens": (BertForTokenClassification, BertConfig)}


def batch(classes: int | None = None):
    """(ids [2, SEQ], attention_mask, labels): row 1 right-padded by 5 (over a chunk boundary),
    labels on a few tokens only (masked-LM style) or on every real token (token classes)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 5:] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    if classes is not None:
        return ids, mask, torch.randint(0, classes, (2, SEQ), generator=gen).masked_fill(mask == 0, -100)
    labels = torch.full_like(ids, -100)
    for row, col in ((0, 1), (0, 2), (0, 4), (0, 9), (0, 15), (1, 3), (1, 7)):  # 4 on rank 0, 3 on rank 1
        labels[row, col] = ids[row, col]
        ids[row, col] = 2  # the [MASK] token
    return ids, mask, labels


def check_encoder(name: str, comm: str, tp: int = 1):
    smp.init({"context_parallel_degree": 2, "tensor_parallel_degree": tp})
    cls, config = MODELS[name]
    torch.manual_seed(0)
    ref = cls(config(**SIZES, **({"num_labels": 5} if name == "bert_tokens" else {})))
    model = smp.transform(copy.deepcopy(ref), cp_comm_type=comm)
    ids, mask, labels = batch(5 if name == "bert_tokens" else None)
    want = ref(ids, attention_mask=mask, labels=labels)
    mine = smp.get_batch_for_cp_rank((ids, mask, labels))
    got = model(input_ids=mine[0], attention_mask=mine[1], labels=mine[2])
    assert_close(full_logits(got.logits), want.logits, f"{name} logits", terms=SEQ)
    assert_close(cp_mean(got.loss), want.loss, f"{name} loss")
    want.loss.backward()
    got.loss.backward()
    average_grads(model)
    _assert_module_grads_match(ref, model, rerun=lambda m: m(ids, attention_mask=mask, labels=labels).loss)


@pytest.mark.parametrize("name, comm, tp", [("bert", "p2p", 1), ("bert", "all_gather", 1), ("roberta", "p2p", 1),
                                            ("roberta", "all_gather", 1), ("bert_tokens", "p2p", 1),
                                            ("bert", "all_gather", 2)])
def test_encoder_equals_one_process(name, comm, tp):
    harness.run(2 * tp, check_encoder, name, comm, tp)


def check_refused_head():
    smp.init({"context_parallel_degree": 2})
    model = BertForSequenceClassification(BertConfig(**SIZES))
    try:
        smp.transform(model)
    except NotImplementedError as e:
        return str(e)
    return "none"


def test_a_pooling_head_is_refused():
    out = harness.run(2, check_refused_head)
    assert "BertForSequenceClassification is not implemented: its head needs the whole sequence" in out[0], out
