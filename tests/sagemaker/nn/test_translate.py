"""HF <-> distributed state-dict translation for the six architectures, at TP=1, 2 and 4.

A failure means a key table in modelparallel/models/<arch>.py (or the engine in nn/huggingface/
translate.py) maps a key or a fused tensor wrongly. The reference is always an untouched HF model:
its outputs, and its own ``load_state_dict(strict=True)``.
"""

import pytest
import torch
import transformers as T

import harness
import modelparallel as smp
from reference import assert_close
from modelparallel.sagemaker.nn.huggingface import bert, gpt2, gptj, gptneo, llama, roberta

ARCHS = {
    "gpt2": (lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1001, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             T.GPT2LMHeadModel, gpt2.translate_hf_state_dict_to_smdistributed_gpt2,
             gpt2.translate_state_dict_to_hf_gpt2),
    "bert": (lambda: T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=1001, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             T.BertForMaskedLM, bert.translate_hf_state_dict_to_smdistributed_bert, bert.translate_state_dict_to_hf_bert),
    "roberta": (lambda: T.RobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, vocab_size=1001, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0),
                T.RobertaForMaskedLM, roberta.translate_state_dict_to_smdistributed,
                roberta.translate_state_dict_to_hf_roberta),
    "gptj": (lambda: T.GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=1001, rotary_dim=8, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             T.GPTJForCausalLM, gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj,
             gptj.translate_state_dict_to_hf_gptj),
    "gpt_neo": (lambda: T.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=1001,
                                       max_position_embeddings=32, attention_types=[[["global", "local"], 1]],
                                       window_size=4, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0),
                T.GPTNeoForCausalLM, gptneo.translate_hf_state_dict_to_smdistributed_gptneo,
                gptneo.translate_state_dict_to_hf_gptneo),
    "llama": (lambda: T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                    intermediate_size=128, vocab_size=1001, tie_word_embeddings=True),
              T.LlamaForCausalLM, llama.translate_hf_state_dict_to_smdistributed_llama,
              llama.translate_state_dict_to_hf_llama),
}
IDS = (torch.arange(24).reshape(2, 12) * 37) % 1001


def _hf(arch, seed):
    make_config, cls, _, _ = ARCHS[arch]
    torch.manual_seed(seed)
    return cls(make_config()).eval()


def check_translation(arch, tp, exported_elsewhere=None):
    _, cls, from_hf, to_hf = ARCHS[arch]
    reference = _hf(arch, seed=0)
    want = reference(IDS).logits
    smp.init({"tensor_parallel_degree": tp, "random_seed": 1})
    model = smp.DistributedModel(_hf(arch, seed=1)).eval()
    source = exported_elsewhere if exported_elsewhere is not None else reference.state_dict()
    model.load_state_dict(from_hf(source))
    assert_close(model(IDS).logits, want)
    exported = to_hf(model.state_dict())
    fresh = _hf(arch, seed=2)
    fresh.load_state_dict(exported, strict=True)
    assert_close(fresh(IDS).logits, want)
    inp, out = fresh.get_input_embeddings().weight, fresh.get_output_embeddings().weight
    if getattr(fresh.config, "tie_word_embeddings", False):
        assert inp.data_ptr() == out.data_ptr(), "exported model lost the embedding / LM-head tie"
    return {k: v.clone() for k, v in exported.items()}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hf_round_trip_is_identity(arch):
    _, _, from_hf, to_hf = ARCHS[arch]
    sd = _hf(arch, seed=0).state_dict()
    back = to_hf(from_hf(sd))
    assert set(back) == set(sd)
    for key, tensor in sd.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_export_at_tp2_loads_at_tp1_tp2_tp4(arch):
    exported = harness.run(2, check_translation, arch, 2)[0]
    for tp in (1, 4):
        harness.run(tp, check_translation, arch, tp, exported)


def test_base_model_keys_translate_too():
    sd = T.GPT2Model(ARCHS["gpt2"][0]()).state_dict()
    dist = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(sd)
    assert dist["h.0.attn.c_attn.weight"].shape == (64, 3, 64)
    assert set(gpt2.translate_state_dict_to_hf_gpt2(dist)) == set(sd)


def test_unknown_key_named_with_architecture():
    sd = _hf("llama", seed=0).state_dict()
    with pytest.raises(KeyError, match=r"keys not of a gpt2 model: \['model.embed_tokens.weight'"):
        gpt2.translate_hf_state_dict_to_smdistributed_gpt2(sd)
    with pytest.raises(KeyError, match="'transformer.wte.weight' is not a key of a llama model"):
        llama.translate_state_dict_to_hf_llama(_hf("gpt2", seed=0).state_dict())


def test_legacy_masks_added_only_on_request():
    hf = _hf("gpt2", seed=0)
    dist = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(hf.state_dict())
    assert not any(k.endswith(".attn.bias") for k in gpt2.translate_state_dict_to_hf_gpt2(dist))
    hf.load_state_dict(gpt2.translate_state_dict_to_hf_gpt2(dist, 16), strict=True)  # transformers 5: no masks
    with pytest.raises(ValueError, match="legacy_buffers=True needs max_seq_len"):
        gpt2.translate_state_dict_to_hf_gpt2(dist, legacy_buffers=True)
    legacy = gpt2.translate_state_dict_to_hf_gpt2(dist, max_seq_len=16, legacy_buffers=True)
    assert torch.equal(legacy["transformer.h.1.attn.bias"], torch.tril(torch.ones(16, 16, dtype=torch.bool))[None, None])
    assert "transformer.h.1.attn.bias" not in gpt2.translate_hf_state_dict_to_smdistributed_gpt2(legacy)
    neo_config = ARCHS["gpt_neo"][0]()
    neo = gptneo.translate_state_dict_to_hf_gptneo(_hf("gpt_neo", seed=0).state_dict(), 8, config=neo_config,
                                              legacy_buffers=True)
    local = neo["transformer.h.1.attn.attention.bias"][0, 0]
    assert local[7, 3] == 0 and local[7, 4] == 1 and local[7, 7] == 1, "local layer keeps only its window of 4"


def test_fused_tensor_that_cannot_split_refused():
    sd = _hf("gpt2", seed=0).state_dict()
    sd["transformer.h.0.attn.c_attn.bias"] = torch.zeros(190)
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn.bias: dim 0 of shape \(190,\) does not split"):
        gpt2.translate_hf_state_dict_to_smdistributed_gpt2(sd)


def test_sagemaker_functions_keep_their_names_and_pickle():
    """Generated from the key tables, SageMaker's functions still carry their own names and
    signatures, and pickle by reference (they are passed to other processes as translate hooks)."""
    import inspect
    import pickle

    for module in (bert, gpt2, gptj, gptneo, llama, roberta):
        arch = module.__name__.rpartition(".")[2]
        export = getattr(module, f"translate_state_dict_to_hf_{arch}")
        import_ = getattr(module, f"translate_hf_state_dict_to_smdistributed_{arch}")
        assert export.__name__ == f"translate_state_dict_to_hf_{arch}"
        want = ["state_dict", "max_seq_len", *(["config"] if arch == "gptneo" else []), "legacy_buffers"]
        assert list(inspect.signature(export).parameters) == want, (arch, inspect.signature(export))
        assert list(inspect.signature(import_).parameters) == ["state_dict"]
        for fn in (export, import_):
            assert pickle.loads(pickle.dumps(fn)) is fn, fn.__name__
    assert list(inspect.signature(gptj.translate_hf_gptj_state_dict_to_smdistributed).parameters) == [
        "state_dict", "max_seq_len"]
