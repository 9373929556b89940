"""Full checkpoints of models that are not Hugging Face architectures: built from ``smp.nn``
modules, or from a user's modules registered with ``tp_register_with_module`` (a plan with a
fused q|k|v, and SageMaker's form replacing a layer by an ``smp.nn`` layer).

Each model is saved at TP=2 in both full forms, a directory of safetensors (``partial=False``)
and SageMaker's single file (``tag="fullmodel.pt"``); both must load into the unsharded module
with ``load_state_dict`` (no missing or unexpected key, every tensor bit-equal to the model the
distributed one was copied from) and resume at TP=1 and TP=4. A failure means the export wrote
the distributed layout (a fused projection kept as [3, n, in]) or keys of another layout, or the
loader could not map them back (modelparallel/checkpoint/format/layouts.py, full.py, full_load.py,
single_file.py).
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import harness
import modelparallel as smp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))

from custom_block import BLOCK_PLAN, Block, TinyLM  # noqa: E402
from test_tp_register import CFG, MyLayer, Net  # noqa: E402

LM_HEAD = dict(num_layers=2, num_attention_heads=4, attention_head_size=8, hidden_size=32, intermediate_size=64,
               vocab_size=64, num_positions=16, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
               causal_mask_size=8)


def _register_layer():
    smp.tp_register_with_module(MyLayer, smp.nn.DistributedTransformerLayer, init_hook=lambda config: ((), config),
                                forward_hook=lambda hidden_states, attention_mask=None: (((hidden_states, None),), {}),
                                return_hook=lambda out: out[0])


def unsharded(kind: str, seed: int = 0, marked: bool = False) -> nn.Module:
    """The model as the user builds it (seeded: the same on every rank and every call)."""
    torch.manual_seed(seed)
    if kind == "smp.nn":
        return smp.nn.DistributedTransformerLMHead(**LM_HEAD)
    if kind == "plan":
        return TinyLM(vocab=64, dim=64)
    return Net(MyLayer, CFG, marked=marked)


def distributed(kind: str, tp: int, seed: int):
    """The model of ``seed`` at TP degree ``tp`` (seed 0: the one ``unsharded`` builds)."""
    smp.init({"tensor_parallel_degree": tp, "random_seed": seed})
    if kind == "plan":
        smp.tp_register_with_module(Block, BLOCK_PLAN)
    elif kind == "registered":
        _register_layer()
    return smp.DistributedModel(unsharded(kind, seed, marked=True))


def save_both(kind: str, path: str) -> dict:
    distributed(kind, 2, 0)
    smp.save_checkpoint(path, "full", partial=False, user_content={"kind": kind})
    smp.save_checkpoint(path, "fullmodel.pt", partial=False, user_content={"kind": kind})
    return {k: v.clone() for k, v in unsharded(kind).state_dict().items()}


def resume(kind: str, path: str, tp: int, tag: str, want: dict):
    model = distributed(kind, tp, 7)
    content = smp.resume_from_checkpoint(path, tag, partial=False)
    got = model.state_dict()  # gathered, at the distributed layout (fused projections as [3, n, ...])
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    bad = [k for k, v in want.items() if not torch.equal(got[k].reshape(v.shape), v)]
    assert not bad, f"differ after resuming {tag} at tp={tp}: {bad}"
    return content


@pytest.mark.parametrize("kind", ["smp.nn", "plan", "registered"])
def test_full_checkpoints_load_into_the_unsharded_module_and_at_any_degree(tmp_path, kind):
    want = harness.run(2, save_both, kind, str(tmp_path))[0]
    assert sorted(os.listdir(tmp_path)) == [".mp-lock", "full", "fullmodel.pt", "newest", "user_content_full",
                                            "user_content_fullmodel.pt"]
    for loaded in (load_file(tmp_path / "full" / "full_state_dict.safetensors"),
                   torch.load(tmp_path / "fullmodel.pt", weights_only=True)):
        module = unsharded(kind, seed=3)
        result = module.load_state_dict(loaded, strict=False)
        entries = module.state_dict(keep_vars=True)
        assert not result.unexpected_keys, result
        for key in result.missing_keys:  # only tied duplicates are left out, as save_pretrained does
            assert any(entries[key] is entries[k] for k in loaded), f"{key} missing from the export"
        assert all(torch.equal(module.state_dict()[k], v) for k, v in want.items()), "loaded into the unsharded module"
    for world, tag in ((1, "full"), (4, "fullmodel.pt")):
        assert harness.run(world, resume, kind, str(tmp_path), world, tag, want)[0] == {"kind": kind}
