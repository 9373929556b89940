"""Every built-in architecture splits into pipeline stages and trains like one Hugging Face
process: GPT-J (rotary, untied head with bias), GPT-Neo (alternating global / local attention,
tied head), Llama tied, Mistral (sliding window), RoBERTa (MLM decoder tied to the embeddings,
uneven vocabulary) and BERT / RoBERTa sequence classifiers (pooler and classifier on the last
stage), at pipeline degree 2, also with tensor parallelism beside; and OLMo, which has no
architecture record: its split is read from transformers' ``base_model_pp_plan`` (its TP plan
from ``base_model_tp_plan``).

A failure means the architecture's pipeline split (``Architecture.pipeline`` in
modelparallel/models/<arch>.py; for OLMo ``pipeline.split.hf_pipeline_split``) names the wrong
blocks, embeddings or final modules, or the stage's first block receives its input under another
argument name.
"""

import copy

import pytest
import torch
from transformers import (BertConfig, BertForSequenceClassification, GPTJConfig, GPTJForCausalLM, GPTNeoConfig,
                          GPTNeoForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          OlmoConfig, OlmoForCausalLM, RobertaConfig, RobertaForMaskedLM, RobertaForSequenceClassification)

import harness
import modelparallel as smp
from reference import NOISE_FACTOR, _fp32_gradient_noise, as_hf, tolerance
from test_pipeline_training import global_batch, my_rows

VOCAB = 61
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
ENCODER = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
               max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)

MODELS = {
    "gptj": lambda: GPTJForCausalLM(GPTJConfig(n_embd=32, n_layer=4, n_head=4, rotary_dim=4, n_positions=16,
                                               vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                               **TOKENS)),
    "gptneo": lambda: GPTNeoForCausalLM(GPTNeoConfig(hidden_size=32, num_layers=4, num_heads=4,
                                                     attention_types=[[["global", "local"], 2]], window_size=4,
                                                     max_position_embeddings=16, vocab_size=VOCAB, resid_dropout=0.0,
                                                     embed_dropout=0.0, attention_dropout=0.0, **TOKENS)),
    "llama_tied": lambda: LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                                       max_position_embeddings=16, tie_word_embeddings=True, **TOKENS)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                                        max_position_embeddings=16, sliding_window=4, **TOKENS)),
    "olmo": lambda: OlmoForCausalLM(OlmoConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                               max_position_embeddings=16, **TOKENS)),
    "roberta_mlm": lambda: RobertaForMaskedLM(RobertaConfig(**ENCODER)),
    "roberta_cls": lambda: RobertaForSequenceClassification(RobertaConfig(**ENCODER, num_labels=3)),
    "bert_cls": lambda: BertForSequenceClassification(BertConfig(**ENCODER, num_labels=3)),
}


def _labels(arch, ids):
    return (ids.sum(dim=1) % 3) if arch.endswith("_cls") else ids


def _one_step(arch, pp, tp):
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2, "random_seed": 1})
    torch.manual_seed(1)
    ref = MODELS[arch]()
    model = smp.DistributedModel(copy.deepcopy(ref))
    ids = global_batch(0) + 3  # no pad, bos or eos token: RoBERTa's positions count non-pad tokens
    ids = ids % VOCAB
    ref(ids, labels=_labels(arch, ids)).loss.backward()

    @smp.step
    def step(ids, labels):
        out = model(ids, labels=labels)
        model.backward(out.loss)
        return out.loss

    mine = my_rows(ids)
    step(mine, _labels(arch, mine))
    _grads_match(ref, model, ids, _labels(arch, ids))
    return sorted(n for n, _ in model.module.named_parameters(remove_duplicate=False))


def _grads_match(ref, model, ids, labels):
    """Every local gradient equals HF's (see test_pipeline_training.assert_stage_grads_match)."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    noise = _fp32_gradient_noise(ref, lambda twin: twin(ids, labels=labels).loss)
    for name, p in model.module.named_parameters():
        expected = want[name].grad
        atol = tolerance(expected) + NOISE_FACTOR * noise.get(name, 0.0)
        torch.testing.assert_close(as_hf(p.grad, expected), expected, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("world, pp, tp", [(2, 2, 1), (4, 2, 2)])
def test_every_architecture_at_pipeline_degree_2(arch, world, pp, tp):
    out = harness.run(world, _one_step, arch, pp, tp)
    held = {n for names in out for n in names}
    assert held == {n for n, _ in MODELS[arch]().named_parameters(remove_duplicate=False)}
