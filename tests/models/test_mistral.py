"""Mistral, the architecture added as one file (modelparallel/models/mistral.py), equals
single-process Hugging Face at TP=2: logits, loss, every gradient, and state-dict translation.

A failure in logits or gradients means the plan Mistral takes from Llama does not fit its module
tree (look at models/mistral.py, then models/llama.py); a failure before any number is compared
(no plan, no key table) means the registry in models/__init__.py did not discover the file.
"""

import torch
from transformers import MistralConfig, MistralForCausalLM

import harness
from modelparallel.models import table_for
from modelparallel.models._translate import from_hf, to_hf
from reference import assert_close, assert_grads_match, build_pair

VOCAB = 1001  # uneven vocabulary shards at TP=2


def _config():
    # grouped-query attention (4 query heads, 2 KV heads) and a window of 4 < the 12-token sequence,
    # so the sliding window really masks
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=32, sliding_window=4, vocab_size=VOCAB,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return config


def check_mistral(tp):
    ref, model = build_pair(MistralForCausalLM, _config(), tp)
    attn = model.module.model.layers[0].self_attn
    assert attn.q_proj.weight.to_local().shape == (32, 64) and attn.k_proj.weight.to_local().shape == (16, 64), \
        "Mistral's q/k/v are not column parallel with whole heads per rank"
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    want, got = ref(ids, attention_mask=mask, labels=labels), model(ids, attention_mask=mask, labels=labels)
    assert_close(got.logits, want.logits, what="mistral logits")
    assert_close(got.loss, want.loss, what="mistral loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model, rerun=lambda m: m(ids, attention_mask=mask, labels=labels).loss)
    table = table_for("mistral")
    exported = to_hf(table, model.state_dict())
    assert exported.keys() == ref.state_dict().keys()
    for key, t in ref.state_dict().items():
        assert torch.equal(exported[key], t), key
    fresh = MistralForCausalLM(_config())
    fresh.load_state_dict(to_hf(table, from_hf(table, ref.state_dict())), strict=True)
    assert_close(fresh(ids, attention_mask=mask).logits, want.logits, what="mistral after a round trip")


def test_mistral_tp2_equals_hf():
    harness.run(2, check_mistral, 2)
