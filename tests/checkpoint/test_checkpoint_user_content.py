"""User content holding numpy values and Hugging Face configs saves and loads without
``trust_user_content=True``, and loading still never runs code named by the file.

A failure in the first test means such values were refused or came back changed (type, dtype,
value); in the others, that a value outside the allow-list was stored, or that a crafted file
could make the loader build a class of its choosing (modelparallel/checkpoint/format/plain.py);
in the last, that a user dict shaped like the stored form of a ``defaultdict`` came back as one.
"""

import collections
import io
import os

import numpy as np
import pytest
import torch
from transformers import GPT2Config, LlamaConfig, PretrainedConfig

import harness
import modelparallel as smp
from ckpt_helpers import build, error_of
from modelparallel.checkpoint.format import plain


def content():
    return {"np_f32": np.float32(1.5), "np_i64": np.int64(-3), "np_bool": np.bool_(True),
            "np_array": np.arange(6, dtype=np.float16).reshape(2, 3),
            "gpt2": GPT2Config(n_layer=3, n_embd=48), "llama": LlamaConfig(num_attention_heads=8, num_key_value_heads=2),
            "base": PretrainedConfig(note="x"), "nested": [{"cfg": GPT2Config()}, collections.OrderedDict(a=np.float64(2))]}


def same(a, b) -> bool:
    if isinstance(a, PretrainedConfig):
        return type(a) is type(b) and a.to_dict() == b.to_dict()
    if isinstance(a, (np.generic, np.ndarray)):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def round_trip(path: str):
    build()
    smp.save_checkpoint(path, "a", user_content=content())
    smp.save_checkpoint(path, "f", partial=False, user_content=content())
    smp.save(content(), os.path.join(path, "legacy.pt"), partial=False)
    smp.barrier()
    return [smp.resume_from_checkpoint(path, "a"), smp.resume_from_checkpoint(path, "f", partial=False),
            smp.load(os.path.join(path, "legacy.pt"), partial=False)]


def test_numpy_values_and_hf_configs_round_trip_without_trust(tmp_path):
    for got in harness.run(2, round_trip, str(tmp_path))[0]:
        want = content()
        bad = [k for k in want if not same(want[k], got[k])]
        assert not bad, {k: (want[k], got[k]) for k in bad}


class MyConfig(PretrainedConfig):
    model_type = "my-model"


def refuse_custom(path: str) -> dict:
    build()
    return {"custom config": error_of(smp.save_checkpoint, path, "a", user_content={"c": MyConfig()}),
            "numpy strings": error_of(smp.save_checkpoint, path, "b", user_content=np.array(["a", "b"]))}


def test_values_outside_the_allow_list_are_refused_at_save(tmp_path):
    for msgs in harness.run(2, refuse_custom, str(tmp_path)):
        assert "test_checkpoint_user_content.MyConfig cannot be stored safely" in msgs["custom config"], msgs
        assert "numpy value of dtype <U1 cannot be stored safely" in msgs["numpy strings"], msgs
    assert not (tmp_path / "a_partial").exists() and not (tmp_path / "b_partial").exists(), "nothing written"


@pytest.mark.parametrize("crafted", [
    {plain.VALUE: "hf_config", "class": "GPT2Config", "model_type": "llama", "config": {}},
    {plain.VALUE: "hf_config", "class": "Popen", "model_type": None, "config": {}},
    {plain.VALUE: "os.system", "data": "echo PWNED"},
])
def test_crafted_tags_name_no_class_the_loader_builds(crafted):
    """A forged tagged value is refused: the tag selects one of this module's constructors, and
    a config class must be the one transformers registers for the stored model_type."""
    buf = io.BytesIO()
    torch.save(crafted, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    with pytest.raises(ValueError, match="not one transformers registers|unknown stored value"):
        plain.from_plain(loaded)


def marker_shaped(path: str):
    build()
    content = {"__modelparallel_defaultdict__": "int", "items": {"a": 1}}
    smp.save_checkpoint(path, "a", user_content={"x": content, "d": collections.defaultdict(int, {"b": 2})})
    smp.save({"x": content}, os.path.join(path, "legacy.pt"), partial=False)
    smp.barrier()
    return smp.resume_from_checkpoint(path), smp.load(os.path.join(path, "legacy.pt"), partial=False)


def test_a_user_dict_shaped_like_the_defaultdict_marker_comes_back_as_it_was(tmp_path):
    content, legacy = harness.run(2, marker_shaped, str(tmp_path))[0]
    want = {"__modelparallel_defaultdict__": "int", "items": {"a": 1}}
    assert type(content["x"]) is dict and content["x"] == want, content
    assert type(content["d"]) is collections.defaultdict and content["d"] == {"b": 2}
    assert type(legacy["x"]) is dict and legacy["x"] == want, legacy
