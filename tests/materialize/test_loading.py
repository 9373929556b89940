"""Shard-on-read loading of HF safetensors checkpoints into meta-built distributed models.

A failure means modelparallel/loading.py (or meta.py / hf_init.py, which it uses) loads something
other than what HF's own ``from_pretrained`` loads: compare which quantity differs. Logits only
with a right ``inv_freq`` -> a block read at the wrong offset (uneven vocab shards, packed
c_attn chunks); ``inv_freq`` wrong -> buffers were not recomputed after the meta build (training
would start from a loss of 3.6 instead of 11); a refusal test failing -> a bad checkpoint got (partly) loaded.
"""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from reference import assert_close
from modelparallel.materialize import meta

IDS = torch.tensor([[3, 17, 42, 99, 5, 0, 64, 23], [8, 8, 1, 77, 100, 31, 2, 9]])


def llama_cfg(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    return LlamaConfig(**{**base, **kw})


def gpt2_cfg():
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=32, bos_token_id=0,
                      eos_token_id=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny Llama (untied) and GPT-2 (tied, packed c_attn) saved by HF, single file and sharded."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    llama, gpt2 = LlamaForCausalLM(llama_cfg()), GPT2LMHeadModel(gpt2_cfg())
    out = {}
    for name, model in (("llama", llama), ("gpt2", gpt2)):
        model.save_pretrained(root / name)
        model.save_pretrained(root / f"{name}-sharded", max_shard_size="40KB")
        out[name], out[f"{name}-sharded"] = str(root / name), str(root / f"{name}-sharded")
    LlamaForCausalLM(llama_cfg(intermediate_size=96)).save_pretrained(root / "llama-wrong")
    out["llama-wrong"] = str(root / "llama-wrong")
    return out


def load_and_compare(cls, cfg, path, how):
    smp.init({"tensor_parallel_degree": 2})
    ref = cls.from_pretrained(path)
    if how == "accelerate":
        from accelerate import init_empty_weights
        with init_empty_weights():
            model = cls(cfg)
    else:
        with torch.device("meta"):
            model = cls(cfg)
    model = smp.DistributedModel(model)
    assert meta.has_meta(model.module), "the meta model got storage before loading"
    with pytest.raises(smp.MetaTensorError, match="load_hf_checkpoint"):
        model(IDS)
    smp.load_hf_checkpoint(model, path)
    model.eval()  # from_pretrained returns eval mode; GPT-2's dropout is on
    assert_close(model(IDS).logits, ref(IDS).logits)
    for name, buf in ref.named_buffers():
        torch.testing.assert_close(model.module.get_buffer(name), buf, msg=lambda m, n=name: f"buffer {n}: {m}")
    head = model.module.lm_head.weight
    if cfg.tie_word_embeddings:
        assert head is model.module.get_input_embeddings().weight, "tie lost"
    local = head.to_local()
    assert local.shape[0] == (51 if smp.tp_rank() == 0 else 50), "uneven vocab shard"
    start = 51 * smp.tp_rank()
    torch.testing.assert_close(local, ref.lm_head.weight[start:start + local.shape[0]])


@pytest.mark.parametrize("arch", ["llama", "llama-sharded", "gpt2", "gpt2-sharded"])
def test_shard_on_read_equals_from_pretrained(checkpoints, arch):
    cls, cfg = (LlamaForCausalLM, llama_cfg()) if arch.startswith("llama") else (GPT2LMHeadModel, gpt2_cfg())
    harness.run(2, load_and_compare, cls, cfg, checkpoints[arch], "meta")


def test_accelerate_empty_weights_model_loads(checkpoints):
    harness.run(2, load_and_compare, LlamaForCausalLM, llama_cfg(), checkpoints["llama"], "accelerate")


def refuse_wrong_shapes(path):
    smp.init({"tensor_parallel_degree": 2})
    with torch.device("meta"):
        model = smp.DistributedModel(LlamaForCausalLM(llama_cfg()))
    with pytest.raises(ValueError) as err:
        smp.load_hf_checkpoint(model, path)
    assert meta.meta_names(model.module) == meta.meta_names(model.module) and not any(
        not meta.is_meta(p) for p in model.parameters()), "a refused checkpoint allocated or loaded tensors"
    return str(err.value)


def test_checkpoint_of_another_config_is_refused_naming_tensors(checkpoints):
    msg = harness.run(2, refuse_wrong_shapes, checkpoints["llama-wrong"])[0]
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "(96, 64)" in msg and "(128, 64)" in msg, msg


def refuse_unusable_meta_models():
    smp.init({"tensor_parallel_degree": 2})
    with torch.device("meta"):
        odd = LlamaForCausalLM(llama_cfg(hidden_size=48, num_attention_heads=3, num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_attention_heads = 3 is not divisible by tensor_parallel_degree 2"):
        smp.DistributedModel(odd)
    assert all(meta.is_meta(p) for p in odd.parameters()), "memory allocated before the refusal"
    with torch.device("meta"):
        model = smp.DistributedModel(LlamaForCausalLM(llama_cfg()))
    for call in (model.state_dict, model.local_state_dict):
        with pytest.raises(smp.MetaTensorError, match="has no weights yet"):
            call()


def test_meta_models_refused_where_weights_are_needed():
    harness.run(2, refuse_unusable_meta_models)


def test_missing_keys_listed_and_loaded_only_when_not_strict(checkpoints, tmp_path):
    """A checkpoint without a layer norm: refused when strict; with strict=False the model's own
    init fills it (norm weights are ones) and the guard finds nothing on meta."""
    from safetensors.torch import load_file, save_file
    sd = load_file(checkpoints["llama"] + "/model.safetensors")
    del sd["model.norm.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_cfg())
    with pytest.raises(ValueError, match=r"missing keys \['model.norm.weight'\]"):
        smp.load_hf_checkpoint(model, tmp_path)
    result = smp.load_hf_checkpoint(model, tmp_path, strict=False)
    assert result.missing_keys == ["model.norm.weight"]
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert not meta.has_meta(model)


def test_bf16_checkpoint_cast_on_read_and_direct_reads_exact(checkpoints, tmp_path):
    """A bf16 checkpoint read into an fp32 model goes through the casting path; the fp32 one
    through direct byte-range reads: both must give HF's tensors exactly."""
    ref = LlamaForCausalLM.from_pretrained(checkpoints["llama"])
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(tmp_path)
    for path, want_dtype in ((tmp_path, torch.bfloat16), (checkpoints["llama"], torch.float32)):
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_cfg())
        smp.load_hf_checkpoint(model, path)
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32
            assert torch.equal(p, ref.get_parameter(name).to(want_dtype).float()), name
