"""Sequence parallelism (``sequence_parallel``) on the decoder families added with issue 31: the
families known to run under it (Qwen2, Gemma, Gemma 2, Falcon; at TP 4 with KV-head replication
too) equal one Hugging Face process in logits, loss and every gradient with a padded batch; the
others (GPT-NeoX, Qwen3, Phi-3, OPT) and any model on the automatic plan are refused with
``NotImplementedError`` naming the feature, rather than run unchecked.

A failure of a family that runs -> its shared inputs or per-rank sizes under the sequence split
(tp/sequence.py, its modelparallel/models/<arch>.py); a refusal that does not come -> the
family's ``ArchSpec.sequence_parallel`` or tp/model_checks.refuse_sequence_parallel.
"""

import copy

import pytest
import torch
import transformers as T

import harness
import modelparallel as smp
from reference import assert_close, assert_grads_match
from test_decoder_families import FAMILIES, SMALL, _batch

RUNS = [("qwen2", 2), ("gemma", 2), ("gemma2", 2), ("falcon", 2), ("qwen2", 4), ("gemma", 4)]
REFUSED = ["gpt_neox", "qwen3", "phi3", "opt"]


def _pair(name, tp):
    smp.init({"tensor_parallel_degree": tp, "sequence_parallel": True, "prescaled_batch": True})
    cls, config = FAMILIES[name]
    torch.manual_seed(0)
    ref = cls(config())
    return ref, smp.DistributedModel(copy.deepcopy(ref))


def check_equal_to_hf(name, tp):
    ref, model = _pair(name, tp)
    ids, mask = _batch()
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    want, got = ref(**batch), model(**batch)
    assert_close(got.logits, want.logits, what=f"{name} logits")
    assert_close(got.loss, want.loss, what=f"{name} loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model, rerun=lambda m: m(**batch).loss)


@pytest.mark.parametrize("name,tp", RUNS, ids=[f"{n}-tp{t}" for n, t in RUNS])
def test_sequence_parallel_equals_hf(name, tp):
    harness.run(tp, check_equal_to_hf, name, tp)


def check_refused(name):
    smp.init({"tensor_parallel_degree": 2, "sequence_parallel": True})
    if name == "olmo":  # no model file: the automatic plan
        model = T.OlmoForCausalLM(T.OlmoConfig(num_attention_heads=4, intermediate_size=128, **SMALL))
    else:
        model = FAMILIES[name][0](FAMILIES[name][1]())
    with pytest.raises(NotImplementedError) as info:
        smp.DistributedModel(model)
    return str(info.value)


@pytest.mark.parametrize("name", REFUSED + ["olmo"])
def test_other_families_refused_naming_the_feature(name):
    for msg in harness.run(2, check_refused, name):
        assert msg.startswith("sequence_parallel for ") and msg.endswith("is not implemented"), msg
        assert f"plan ({name!r}) is not known to reproduce it under sequence parallelism" in msg, msg
