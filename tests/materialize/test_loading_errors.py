"""A damaged or mismatched safetensors checkpoint is refused in one message naming the file.

``load_hf_checkpoint`` takes no collective, so these run in one process on a meta-built model. A
failure means the user would see a bare library error (safetensors' "incomplete metadata", a
``KeyError: 'weight_map'``) without the file or key at fault, or that a wrong checkpoint got
(partly) loaded: look at ``checkpoint_files``/``plan`` in ``modelparallel/materialize/loading.py``
and ``open_file`` in ``safetensors_io.py``.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import modelparallel as smp
from modelparallel.materialize import meta


def llama_cfg():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved by HF as one file and as several shards with an index."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_cfg())
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    return root


def refused(path, error=ValueError) -> str:
    """The message of loading ``path`` into a fresh meta model; checks nothing was allocated."""
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_cfg())
    with pytest.raises(error) as err:
        smp.load_hf_checkpoint(model, path)
    assert all(meta.is_meta(p) for p in model.parameters()), "a refused checkpoint allocated or loaded tensors"
    return str(err.value)


def damaged_copy(saved, tmp_path, damage) -> str:
    """The single-file checkpoint's directory copied with ``damage(bytes) -> bytes`` applied."""
    shutil.copytree(saved / "single", tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    return str(path)


@pytest.mark.parametrize("damage", [
    pytest.param(lambda b: b[:len(b) // 2], id="truncated_in_the_data"),
    pytest.param(lambda b: b[:5], id="truncated_in_the_header_length"),
    pytest.param(lambda b: b[:8] + b"x" * (len(b) - 8), id="garbage_header"),
])
@pytest.mark.parametrize("open_as", ["directory", "file"])
def test_damaged_file_named(saved, tmp_path, damage, open_as):
    path = damaged_copy(saved, tmp_path, damage)
    msg = refused(os.path.dirname(path) if open_as == "directory" else path)
    assert msg.startswith(path + ": ") and "safetensors" in msg and "\n" not in msg, msg


def sharded_copy(saved, tmp_path) -> tuple:
    shutil.copytree(saved / "sharded", tmp_path / "ckpt")
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    return index, json.loads(index.read_text())


def test_missing_shard_named_with_its_index(saved, tmp_path):
    index, content = sharded_copy(saved, tmp_path)
    shard = sorted(set(content["weight_map"].values()))[1]
    os.remove(index.parent / shard)
    msg = refused(index.parent, FileNotFoundError)
    assert msg.startswith(f"{index}: ") and str(index.parent / shard) in msg and "\n" not in msg, msg


def test_truncated_shard_named(saved, tmp_path):
    index, content = sharded_copy(saved, tmp_path)
    shard = index.parent / sorted(set(content["weight_map"].values()))[1]
    shard.write_bytes(shard.read_bytes()[:-64])
    msg = refused(index.parent)
    assert msg.startswith(f"{shard}: ") and "\n" not in msg, msg


@pytest.mark.parametrize("text", ["{not json", "{}", '{"weight_map": ["a"]}'])
def test_unreadable_index_named(saved, tmp_path, text):
    index, _ = sharded_copy(saved, tmp_path)
    index.write_text(text)
    msg = refused(index.parent)
    assert msg.startswith(f"{index}: ") and "\n" not in msg, msg


def rewritten(saved, tmp_path, key, value) -> str:
    """The single-file checkpoint with tensor ``key`` replaced by ``value``."""
    tensors = load_file(str(saved / "single" / "model.safetensors"))
    tensors[key] = value
    os.makedirs(tmp_path / "ckpt")
    path = str(tmp_path / "ckpt" / "model.safetensors")
    save_file(tensors, path)
    return path


@pytest.mark.parametrize("stored,name", [(torch.ones(64, dtype=torch.int64), "I64"),
                                         (torch.ones(64, dtype=torch.bool), "BOOL")], ids=["int64", "bool"])
def test_non_float_tensor_for_a_float_weight_named(saved, tmp_path, stored, name):
    """Floating-point dtypes are cast on read (a bf16 checkpoint into an fp32 model); an integer
    or boolean tensor where the model holds a float weight is a wrong checkpoint, not a cast."""
    path = rewritten(saved, tmp_path, "model.norm.weight", stored)
    msg = refused(os.path.dirname(path))
    assert f"{path}: model.norm.weight: " in msg and name in msg and "float32" in msg, msg


def test_wrong_shape_named_with_file_and_key(saved, tmp_path):
    path = rewritten(saved, tmp_path, "model.norm.weight", torch.ones(65))
    msg = refused(os.path.dirname(path))
    assert f"{path}: model.norm.weight: " in msg and "(65,)" in msg and "(64,)" in msg, msg


def test_index_placing_a_key_in_the_wrong_shard_named(saved, tmp_path):
    index, content = sharded_copy(saved, tmp_path)
    shards = sorted(set(content["weight_map"].values()))
    key = next(k for k, f in content["weight_map"].items() if f == shards[0])
    content["weight_map"][key] = shards[1]
    index.write_text(json.dumps(content))
    msg = refused(index.parent)
    assert msg == f"{index.parent / shards[1]}: no tensor {key}, which the index places in this file", msg
