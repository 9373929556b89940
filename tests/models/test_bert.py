"""BERT and RoBERTa under tensor parallelism equal single-process Hugging Face.

A failure means the BERT-family plan (modelparallel/models/bert.py, roberta.py), the walker's tie
handling (tp/walker.py: ``tied_holders``, ``_retie``), a style (tp/styles.py) or the masked-LM loss
(tp/loss.py) computes something other than HF. Look first at which quantity differs: hidden
states or logits -> plan or styles; the MLM loss only -> tp/loss.py; only the word-embedding
gradient -> the vocab-parallel embedding (``padding_idx``, uneven shards); "untied" -> the walker's
``_retie``; collective counts -> the colwise style's shared input copy (tp/styles.py).
"""

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, BertLMHeadModel, BertModel,
                          RobertaConfig, RobertaForCausalLM, RobertaForMaskedLM, RobertaForSequenceClassification,
                          RobertaModel)

import harness
import modelparallel as smp
from modelparallel.models import architecture_for
from modelparallel.tp.walker import collect
from reference import (all_reduces, assert_close, assert_grads_match, assert_same_training, build_pair,
                       comm_counts_by_kind)

# Real vocabularies: 30522 rows are uneven at TP=4, 50265 at TP=2 and 4. Padding rows 0 and 1.
ARCHS = {
    "bert": (BertConfig, (BertModel, BertForMaskedLM, BertForSequenceClassification), 30522),
    "roberta": (RobertaConfig, (RobertaModel, RobertaForMaskedLM, RobertaForSequenceClassification), 50265),
}
BIAS_HOLDER = {"bert": "cls.predictions", "roberta": "lm_head"}  # holds the decoder's tied bias


def tiny(arch, layers=2, **kw):
    config_cls, _, vocab = ARCHS[arch]
    base = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                vocab_size=vocab, max_position_embeddings=40, type_vocab_size=2, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    return config_cls(**{**base, **kw})


def shard_edges(vocab: int) -> list[int]:
    """Token ids on the first two rows of every rank's vocabulary shard at TP=2 and 4, and the
    last row: a shard-local ``padding_idx`` (0 or 1) would wrongly zero their gradients."""
    edges = {r * -(-vocab // tp) + k for tp in (2, 4) for r in range(1, tp) for k in (0, 1)}
    return sorted(edges) + [vocab - 1]


def batch(config, seed=1):
    """(ids, attention_mask, token_type_ids) [2, 14]: row 0 holds the shard edges, row 1 ends in
    4 padding tokens (the pad id, mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, config.vocab_size, (2, 14), generator=g)
    edges = torch.tensor(shard_edges(config.vocab_size))
    ids[0, 1:1 + len(edges)] = edges
    ids[1, 10:] = config.pad_token_id
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    types = torch.zeros_like(ids)
    types[0, 7:] = 1
    return ids, mask, types


def mlm_labels(ids, mask):
    """Targets on every other real token, -100 (ignored) elsewhere, as a masked-LM collator does."""
    keep = (torch.arange(ids.shape[1]) % 2 == 1) & (mask == 1)
    return ids.masked_fill(~keep, -100)


def _forward_pair(cls, ref, model, ids, mask, types):
    """HF's and the distributed outputs, and a scalar to backpropagate from each."""
    kw = dict(input_ids=ids, attention_mask=mask, token_type_ids=types)
    if "MaskedLM" in cls.__name__:
        kw["labels"] = mlm_labels(ids, mask)
    elif "Classification" in cls.__name__:
        kw["labels"] = torch.tensor([0, 1])
    want, got = ref(**kw), model(**kw)
    if "labels" in kw:
        return want, got, want.loss, got.loss
    g = torch.Generator().manual_seed(2)
    w, v = torch.randn(want.last_hidden_state.shape, generator=g), torch.randn(want.pooler_output.shape, generator=g)
    def scalar(out):  # random weights: a plain sum would give LayerNorm outputs a degenerate gradient
        return (out.last_hidden_state * w).sum() + (out.pooler_output * v).sum()
    return want, got, scalar(want), scalar(got)


def _check_mlm_head(arch, ref, model, ids, mask, types, want_logits):
    """Decoder tied to the word embeddings (weight) and to its holder (bias), both vocab-sharded;
    logits whole when no labels are given; the state dict is HF's, key for key."""
    m = model.module
    decoder, holder = m.get_output_embeddings(), m.get_submodule(BIAS_HOLDER[arch])
    assert decoder.weight is m.get_input_embeddings().weight, "decoder untied from word embeddings"
    assert decoder.bias is holder.bias, "decoder bias untied from its holder"
    assert isinstance(decoder.bias, DTensor) and decoder.bias.placements == (Shard(0),)
    plain = model(ids, attention_mask=mask, token_type_ids=types).logits
    assert type(plain) is torch.Tensor, "inference logits must be a plain tensor"
    assert_close(plain, want_logits)
    full, hf = model.state_dict(), ref.state_dict()
    assert full.keys() == hf.keys()
    for key, t in hf.items():
        assert torch.equal(full[key], t), key


def check_outputs_and_grads(arch, tp):
    """All three classes: outputs, loss and every gathered gradient equal HF's."""
    config = tiny(arch)
    ids, mask, types = batch(config)
    for cls in ARCHS[arch][1]:
        ref, model = build_pair(cls, config, tp)
        want, got, loss_ref, loss = _forward_pair(cls, ref, model, ids, mask, types)
        for key in [k for k in ("last_hidden_state", "pooler_output", "logits", "loss") if k in want]:
            assert_close(got[key], want[key], what=f"{cls.__name__} {key}")
        loss_ref.backward()
        model.backward(loss)
        assert_grads_match(ref, model, rerun=lambda m: _forward_pair(cls, m, m, ids, mask, types)[2])
        emb = model.module.get_input_embeddings().weight.grad
        if cls in (BertModel, RobertaModel):  # untied: the padding row gets no gradient, as in HF
            assert not emb.full_tensor()[config.pad_token_id].any()
        if "MaskedLM" in cls.__name__:
            _check_mlm_head(arch, ref, model, ids, mask, types, want.logits)


def check_training_steps(arch, tp, steps=10):
    """Ten AdamW steps of masked-LM training follow HF's losses."""
    config = tiny(arch)
    ref, model = build_pair(ARCHS[arch][1][1], config, tp)
    batches = []
    for step in range(steps):
        ids, mask, types = batch(config, seed=100 + step)
        batches.append(dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=mlm_labels(ids, mask)))
    assert_same_training(ref, model, batches)


def collective_counts(arch, layers):
    """Collectives of one masked-LM training step (forward with labels, backward), by kind."""
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})  # same batch on TP ranks
    config = tiny(arch, layers=layers)
    model = smp.DistributedModel(ARCHS[arch][1][1](config))
    ids, mask, types = batch(config)
    with CommDebugMode() as fwd:
        loss = model(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=mlm_labels(ids, mask)).loss
    with CommDebugMode() as bwd:
        model.backward(loss)
    return comm_counts_by_kind(fwd), comm_counts_by_kind(bwd)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_outputs_loss_grads_and_ties(arch, tp):
    harness.run(tp, check_outputs_and_grads, arch, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_ten_adamw_steps(arch, tp):
    harness.run(tp, check_training_steps, arch, tp)


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_two_allreduces_per_layer_each_way_and_no_gather(arch):
    (f2, b2), (f3, b3) = harness.run(2, collective_counts, arch, 2)[0], harness.run(2, collective_counts, arch, 3)[0]
    assert all_reduces(f3) - all_reduces(f2) == 2, (f2, f3)
    assert all_reduces(b3) - all_reduces(b2) == 2, (b2, b3)
    for counts in (f2, b2, f3, b3):
        assert not any("gather" in kind for kind in counts), counts
    # constant part: embedding all-reduce + 2 small loss all-reduces forward; decoder input grad backward
    assert all_reduces(f2) == 2 * 2 + 3, f2
    assert all_reduces(b2) == 2 * 2 + 1, b2


def check_causal_heads(tp):
    """The family's decoder heads (``BertLMHeadModel``, ``RobertaForCausalLM``) declare a causal
    loss next to the masked one: their vocab-parallel loss and gradients equal HF's next-token loss."""
    for arch, cls in (("bert", BertLMHeadModel), ("roberta", RobertaForCausalLM)):
        config = tiny(arch, is_decoder=True)
        ids, mask, types = batch(config)
        kw = dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=ids.masked_fill(mask == 0, -100))
        ref, model = build_pair(cls, config, tp)
        want, got = ref(**kw), model(**kw)
        assert_close(got.logits, want.logits, what=f"{cls.__name__} logits")
        assert_close(got.loss, want.loss, what=f"{cls.__name__} loss (causal, not masked)")
        want.loss.backward()
        model.backward(got.loss)
        assert_grads_match(ref, model, rerun=lambda m: m(**kw).loss)


def test_causal_heads_take_the_causal_loss():
    harness.run(2, check_causal_heads, 2)


def test_heads_not_divisible_named_with_numbers():
    model = BertModel(tiny("bert", vocab_size=100, hidden_size=96, num_attention_heads=6))
    problems = collect(model, architecture_for(model).spec, tp=4).problems
    assert ("BertConfig.num_attention_heads = 6 is not divisible by tensor_parallel_degree 4 "
            "(each rank must hold whole heads)") in problems, problems
    model = RobertaForMaskedLM(tiny("roberta", vocab_size=100, hidden_size=66, num_attention_heads=3))
    problems = collect(model, architecture_for(model).spec, tp=4).problems
    assert ("roberta.encoder.layer.0.attention.self.query: out_features = 66 is not divisible by "
            "tensor_parallel_degree 4") in problems, problems


def test_tie_split_refused_unless_the_holder_is_declared():
    """The decoder bias is tied to a parameter of a module no rule shards: refused by default."""
    for arch in ARCHS:
        model = ARCHS[arch][1][1](tiny(arch, vocab_size=100))
        spec = architecture_for(model).spec
        assert not collect(model, spec, tp=2).problems
        bare = dataclasses.replace(spec, head=dataclasses.replace(spec.head, tied_holders=()))
        holder = BIAS_HOLDER[arch]
        assert (f"tied parameters {holder}.bias, {holder}.decoder.bias would be split between sharded and "
                "replicated modules; plan all of them or none") in collect(model, bare, tp=2).problems
