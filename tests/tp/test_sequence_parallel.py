"""Sequence parallelism inside tensor parallelism (``sequence_parallel`` key; tp/sequence.py) leaves
every one of the six TP architectures equal to one Hugging Face process: logits, loss, every
gradient (norm weights and row-parallel biases, whose gradients are partial per rank, included),
at TP=2 and TP=4, training with AdamW included (with activation checkpointing too); and it
trades each block's all-reduces for all-gathers and reduce-scatters (the same bytes).

Where to look: wrong norm or bias gradients only -> their gradient sum over the ranks
(``SequenceParallel`` style, ``local._row_output``); logits of one architecture only -> a module
of its blocks that reads its input's shape without a ``SharedInput`` gathering at its entry
(models/<arch>.py); every architecture -> the cut and the gather at the blocks' bounds
(``sequence._bounds``) or the collectives themselves.
"""

import copy

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJForCausalLM,
                          GPTNeoConfig, GPTNeoForCausalLM, LlamaConfig, LlamaForCausalLM, RobertaConfig,
                          RobertaForMaskedLM)

import harness
import modelparallel as smp
from reference import (all_reduces, assert_close, assert_grads_match, assert_same_training, comm_counts_by_kind)

VOCAB = 96
DROPOUT_OFF = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

ARCHS = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gptj": lambda: GPTJForCausalLM(GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
                                               vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gptneo": lambda: GPTNeoForCausalLM(GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                                     attention_types=[[["global", "local"], 1]], vocab_size=VOCAB,
                                                     max_position_embeddings=32, resid_dropout=0.0,
                                                     embed_dropout=0.0, attention_dropout=0.0)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                                  max_position_embeddings=32)),
    "bert": lambda: BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, vocab_size=VOCAB, **DROPOUT_OFF)),
    "roberta": lambda: RobertaForMaskedLM(RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                        intermediate_size=64, vocab_size=VOCAB, pad_token_id=1,
                                                        **DROPOUT_OFF)),
}


def _pair(arch: str, tp: int):
    smp.init({"tensor_parallel_degree": tp, "sequence_parallel": True, "prescaled_batch": True})
    torch.manual_seed(0)
    ref = ARCHS[arch]()
    return ref, smp.DistributedModel(copy.deepcopy(ref))


def _batch(seed: int = 1):
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding in the second row: the mask spans the whole sequence
    return ids, mask


def check_equal_to_hf(arch: str, tp: int):
    ref, model = _pair(arch, tp)
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    want = ref(ids, attention_mask=mask, labels=labels)
    with CommDebugMode() as comms:
        got = model(ids, attention_mask=mask, labels=labels)
    assert_close(got.logits, want.logits, f"{arch} logits")
    assert_close(got.loss, want.loss, f"{arch} loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model, rerun=lambda m: m(ids, attention_mask=mask, labels=labels).loss)
    return comm_counts_by_kind(comms)


CASES = [(arch, 2) for arch in ARCHS] + [("llama", 4), ("gpt2", 4)]


@pytest.mark.parametrize("arch, tp", CASES)
def test_sequence_parallel_equals_hf(arch, tp):
    counts = harness.run(tp, check_equal_to_hf, arch, tp)[0]
    layers = 2
    # forward: each block reduce-scatters after its two row-parallel layers instead of all-reducing;
    # all-reduces are left outside the blocks only (embedding, loss statistics)
    assert counts.get("reduce_scatter_tensor", 0) == 2 * layers, counts
    assert counts.get("all_gather_into_tensor", 0) >= 2 * layers - (layers if arch == "gptj" else 0), counts
    assert all_reduces(counts) <= 3, counts


def check_training(arch: str, checkpointed: bool):
    ref, model = _pair(arch, 2)
    if checkpointed:  # recomputation repeats the gathers; saved shards are gathered again in backward
        smp.set_activation_checkpointing(model.module.model.layers if arch == "llama" else model.module.transformer.h)
    batches = [dict(input_ids=_batch(10 + s)[0], labels=_batch(10 + s)[0]) for s in range(5)]
    assert_same_training(ref, model, batches, what=f"{arch} ")


@pytest.mark.parametrize("arch, checkpointed", [("llama", False), ("gpt2", False), ("llama", True)])
def test_training_steps(arch, checkpointed):
    harness.run(2, check_training, arch, checkpointed)


def check_bad_length():
    _, model = _pair("llama", 2)
    ids = torch.randint(3, VOCAB, (2, 7))
    try:
        model(ids)
    except ValueError as e:
        return str(e)
    return "no error"


def test_sequence_not_divisible_by_the_degree():
    out = harness.run(2, check_bad_length)
    assert out[0] == out[1] and "sequence length 7 is not divisible by tensor_parallel_degree 2" in out[0], out
