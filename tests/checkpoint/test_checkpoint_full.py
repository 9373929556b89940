"""Full checkpoints (partial=False): a Hugging Face directory that ``from_pretrained`` loads.

A failure means the streamed export (modelparallel/checkpoint/save/full.py, shards.py) or its loader
(full_load.py) changed a value, a key or the tie: the reference is the single-process HF model
the distributed one was copied from; ``from_pretrained`` must report no missing, unexpected or
mismatched keys, and tied weights must stay one tensor. The vocabulary (1001) is uneven at TP=2.
"""

import copy
import json
import os

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, OlmoConfig,
                          OlmoForCausalLM)

import harness
import modelparallel as smp
from modelparallel.checkpoint.save import full
from modelparallel.sagemaker.nn.huggingface.gpt2 import translate_hf_state_dict_to_smdistributed_gpt2


def cfg():
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=1001, n_positions=16, bos_token_id=0,
                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def export(path: str, max_shard_bytes: int, translate: bool):
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg())
    model = smp.DistributedModel(copy.deepcopy(ref))
    saved = full.MAX_SHARD_BYTES
    full.MAX_SHARD_BYTES = max_shard_bytes
    try:
        smp.save_checkpoint(path, "final", partial=False, user_content={"epoch": 3}, translate_if_full=translate)
    finally:
        full.MAX_SHARD_BYTES = saved
    return ref.state_dict()


def check_from_pretrained(directory, want, tied=True):
    loaded, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == tied, "tie kept (or absent) as saved"
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_full_export_is_an_hf_directory_with_the_same_values(tmp_path):
    want = harness.run(2, export, str(tmp_path), 2**30, True)[0]
    assert sorted(os.listdir(tmp_path / "final")) == ["checkpoint_manifest.json", "config.json", "model.safetensors"]
    assert torch.load(tmp_path / "user_content_final", weights_only=False) == {"epoch": 3}
    assert (tmp_path / "newest").read_text().strip() == "final"
    check_from_pretrained(tmp_path / "final", want)


def test_sharded_export_writes_an_index_that_from_pretrained_follows(tmp_path):
    want = harness.run(4, export, str(tmp_path), 30_000, True)[0]  # TP=2 x DP=2: one TP group sends
    index = json.loads((tmp_path / "final" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    check_from_pretrained(tmp_path / "final", want)


def resume_full(path: str, tp: int, want: dict, defer: bool, translate_function=None):
    smp.init({"tensor_parallel_degree": tp, "random_seed": 7})
    if defer:
        content = smp.resume_from_checkpoint(path, partial=False)
        model = smp.DistributedModel(GPT2LMHeadModel(cfg()))
    else:
        model = smp.DistributedModel(GPT2LMHeadModel(cfg()))
        content = smp.resume_from_checkpoint(path, "final", partial=False, translate_function=translate_function)
    got = model.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key].reshape(value.shape), value), key
    return content


def test_full_checkpoint_resumes_at_another_degree(tmp_path):
    want = harness.run(2, export, str(tmp_path / "hf"), 60_000, True)[0]
    assert harness.run(4, resume_full, str(tmp_path / "hf"), 4, want, True)[0] == {"epoch": 3}
    harness.run(2, resume_full, str(tmp_path / "hf"), 2, want, False, translate_hf_state_dict_to_smdistributed_gpt2)
    harness.run(2, export, str(tmp_path / "plain"), 2**30, False)
    assert os.path.exists(tmp_path / "plain" / "final" / "full_state_dict.safetensors")
    harness.run(1, resume_full, str(tmp_path / "plain"), 1, want, False)


def export_llama(path: str):
    from test_checkpoint import llama_cfg

    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(llama_cfg())
    smp.DistributedModel(copy.deepcopy(ref))
    smp.save_checkpoint(path, "llama", partial=False)
    return ref.state_dict()


def test_llama_with_untied_head_exports_for_from_pretrained(tmp_path):
    want = harness.run(2, export_llama, str(tmp_path))[0]
    check_from_pretrained(tmp_path / "llama", want, tied=False)


def export_untranslated_arch(path: str):
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    ref = OlmoForCausalLM(OlmoConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                                     num_attention_heads=2, max_position_embeddings=16, tie_word_embeddings=True,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2))
    smp.DistributedModel(copy.deepcopy(ref))
    smp.save_checkpoint(path, "opt", partial=False)
    return {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}


def test_model_without_translation_gets_a_plain_full_state_dict(tmp_path):
    from safetensors.torch import load_file

    want = harness.run(2, export_untranslated_arch, str(tmp_path))[0]
    got = load_file(tmp_path / "opt" / "full_state_dict.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def failing_export(path: str):
    """A full save whose writes fail on rank 0 after an earlier good save of the same tag."""
    from modelparallel.checkpoint.save import shards

    smp.init({"tensor_parallel_degree": 2})
    smp.DistributedModel(GPT2LMHeadModel(cfg()))
    smp.save_checkpoint(path, "final", partial=False, user_content="first")
    before = {p: open(os.path.join(path, p), "rb").read() for p in ("user_content_final", "newest")}
    original = shards.ShardWriter.write
    if smp.rank() == 0:
        def boom(*_a, **_k):
            raise OSError("No space left on device (simulated)")
        shards.ShardWriter.write = boom
    try:
        smp.save_checkpoint(path, "final", partial=False, user_content="second")
    except Exception as e:  # noqa: BLE001 - the message is checked
        message = str(e)
    else:
        message = None
    finally:
        shards.ShardWriter.write = original
    after = {p: open(os.path.join(path, p), "rb").read() for p in before}
    assert after == before, "a failed save overwrote nothing"
    return message, sorted(n for n in os.listdir(path) if n != ".mp-lock")


def test_failed_full_export_raises_everywhere_and_keeps_the_previous_one(tmp_path):
    results = harness.run(2, failing_export, str(tmp_path))
    for message, _ in results:
        assert message and "rank 0: OSError: No space left on device (simulated)" in message, message
    assert results[0][1] == ["final", "newest", "user_content_final"], "rank 0 removed the staging before raising"
    assert torch.load(tmp_path / "user_content_final", weights_only=False) == "first"
