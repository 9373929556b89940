"""Bad input under context parallelism: one clear error naming the value, raised on every rank,
never a hang.

Configuration problems (a degree that does not divide the world, an unknown ``cp_comm_type``, an
encoder head that pools the sequence) are refused before any collective. Problems in a batch (a mask of another shape, an odd or
disagreeing length, a key/value cache) are found by each rank and agreed in one small all-gather, so a batch
that is wrong on one rank only stops every rank with that rank's problem. A failure here means
context/inputs.py (``agree``) or context/__init__.py (``check_model``) let a bad input through,
or raised on one rank only (the other ranks would then wait in attention until the timeout).
"""

import copy

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from modelparallel.config import build_config


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64))


def _error(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return type(e).__name__, str(e)
    return "none", ""


def check_batch_problem(case: str):
    smp.init({"context_parallel_degree": 2})
    model = smp.transform(_llama())
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(smp.rank()))
    kwargs = {}
    if case == "mask_shape_on_one_rank":
        kwargs["attention_mask"] = torch.ones_like(ids) if smp.cp_rank() == 0 else torch.ones(2, 6)
    elif case == "mask_4d":
        kwargs["attention_mask"] = torch.ones(2, 1, 8, 16)
    elif case == "odd_length":
        ids = ids[:, :7]
    elif case == "different_lengths":
        ids = ids[:, :6] if smp.cp_rank() == 0 else ids
    elif case == "cache":
        kwargs["past_key_values"] = object()
    elif case == "label_shape":
        kwargs["labels"] = ids[:, :4]
    return _error(lambda: model(ids, **kwargs))


@pytest.mark.parametrize("case, kind, fragment", [
    ("mask_shape_on_one_rank", "ValueError",
     "context-parallel rank 1: its attention_mask has 6 tokens per row where its inputs have 8"),
    ("mask_4d", "NotImplementedError", "its attention_mask has 4 dimensions"),
    ("odd_length", "ValueError", "context-parallel rank 0: its sequence part has 7 tokens, an odd number"),
    ("different_lengths", "ValueError", "rank 0 2 x 6, rank 1 2 x 8"),
    ("cache", "NotImplementedError", "a key/value cache of object under context parallelism is not implemented"),
    ("label_shape", "ValueError", "its labels have 4 tokens per row where its inputs have 8"),
])
def test_a_bad_batch_stops_every_rank(case, kind, fragment):
    out = harness.run(2, check_batch_problem, case)
    assert out[0] == out[1], f"the ranks raised different errors: {out}"
    assert out[0][0] == kind and fragment in out[0][1], out[0]


def check_refused_models():
    smp.init({"context_parallel_degree": 2})
    bert = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=64))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, attn_pdrop=0.1))
    trained = smp.transform(copy.deepcopy(gpt2))
    ids = torch.randint(3, 64, (1, 8))
    dropout = _error(lambda: trained(smp.get_batch_for_cp_rank(ids)))
    trained.eval()
    evaluated = trained(smp.get_batch_for_cp_rank(ids)).logits.shape
    return dict(bert_v2=_error(lambda: smp.transform(bert)), bert_v1=_error(lambda: smp.DistributedModel(bert)),
                comm=_error(lambda: smp.transform(_llama(), cp_comm_type="ring")), dropout=dropout,
                evaluated=tuple(evaluated), split=_error(lambda: smp.get_batch_for_cp_rank(torch.zeros(1, 10))))


def test_refused_models_and_values():
    out = harness.run(2, check_refused_models)
    assert out[0] == out[1]
    info = out[0]
    for api in ("bert_v2", "bert_v1"):
        assert info[api][0] == "NotImplementedError" and "BertForSequenceClassification is not implemented: " \
            "its head needs the whole sequence" in info[api][1]
    assert info["comm"] == ("ValueError", "cp_comm_type='ring': expected one of ('p2p', 'all_gather')")
    assert info["dropout"] == ("none", ""), info["dropout"]  # attention dropout in training runs (test_cp_dropout)
    assert info["evaluated"] == (1, 4, 64)
    assert info["split"][0] == "ValueError" and "sequence length 10 is not divisible by" in info["split"][1]


def test_degree_not_dividing_the_world():
    with pytest.raises(ValueError, match="world size 4 is not divisible by tensor_parallel_degree 2 x "
                                         "context_parallel_degree 4 = 8"):
        build_config({"tensor_parallel_degree": 2, "context_parallel_degree": 4}, 4)
    with pytest.raises(ValueError, match="does not divide the data x context parallel degree 4"):
        build_config({"context_parallel_degree": 2, "hybrid_shard_degree": 3}, 4)
