"""Sequence parallelism (``sequence_parallel``) on the decoder families added with issue 31 and on
the automatic plan: every family (GPT-NeoX with its parallel and its sequential residual, Qwen2,
Qwen3 with its per-head norms, Phi-3 with its fused projections, Gemma, Gemma 2, OPT with its
flattened feed-forward, Falcon, Mistral, Mixtral and Qwen2-MoE with their routers and experts on
sequence shards; at TP 4 with KV-head replication too) equals one Hugging Face process in logits,
loss and every gradient with a padded batch; a MoE model's load-balancing loss, a mean over the
whole sequence, is refused, and so is expert parallelism with it (the experts' gradients are not
summed over the TP ranks' shards). A model on the automatic plan runs
under it once a proxy verifies it there (OLMo with transformers' plan; GPT-NeoX with its file
removed, whose attention needs the sequence gathered at its entry); one that does not reproduce
under it (a feed-forward that mixes the tokens of the sequence) is refused with
``NotImplementedError`` naming the feature.

A failure of one family -> its shared inputs or per-rank sizes under the sequence split
(tp/sequence.py, its modelparallel/models/<arch>.py); OPT only -> the token dimension of
flattened hidden states (``sequence.token_dim``); Qwen3's norm gradients -> the modules
sequence parallelism leaves to their own style (``sequence.apply``); the automatic plan ->
tp/auto/__init__.py (``with_sequence_parallel``).
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
import transformers as T

import harness
import modelparallel as smp
from registry_helpers import FileRemoved
from reference import assert_close, assert_grads_match
from test_decoder_families import FAMILIES, SMALL, VOCAB, _batch, _fp64_finite

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "expert"))
from moe_reference import mixtral_config, qwen2_moe_config  # noqa: E402 - the expert tests' tiny MoE models

MOE = {"mixtral": (T.MixtralForCausalLM, mixtral_config), "qwen2_moe": (T.Qwen2MoeForCausalLM, qwen2_moe_config)}
RUNS = [(name, 2) for name in [*FAMILIES, "mistral", *MOE] if name != "falcon_mha"] + [("qwen2", 4), ("gemma", 4)]


def _olmo():
    return T.OlmoForCausalLM(T.OlmoConfig(num_attention_heads=4, intermediate_size=128, **SMALL))


def _build(name, router_loss=False):
    if name == "olmo":  # no model file: the automatic plan
        return _olmo()
    if name == "mistral":  # sliding window (4) shorter than the sequence
        return T.MistralForCausalLM(T.MistralConfig(num_attention_heads=4, num_key_value_heads=2,
                                                    intermediate_size=128, sliding_window=4, **SMALL))
    if name in MOE:  # routed token by token on each rank's shard; the load-balancing loss is refused
        cls, config = MOE[name]
        config = config()
        config.vocab_size, config.output_router_logits = VOCAB, router_loss
        return cls(config)
    cls, config = FAMILIES[name]
    return cls(config())


def _pair(name, tp, without_file=None):
    smp.init({"tensor_parallel_degree": tp, "sequence_parallel": True, "prescaled_batch": True})
    torch.manual_seed(0)
    ref = _build(name)
    if without_file is None:
        return ref, smp.DistributedModel(copy.deepcopy(ref))
    with FileRemoved(without_file):
        return ref, smp.DistributedModel(copy.deepcopy(ref))


def check_equal_to_hf(name, tp, without_file=None):
    ref, model = _pair(name, tp, without_file)
    ids, mask = _batch()
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    want, got = ref(**padded), model(**padded)
    assert_close(got.logits, want.logits, what=f"{name} logits")
    assert_close(got.loss, want.loss, what=f"{name} loss")
    # OPT's padding mask, built for fp32, is not finite in the fp64 twin measuring rounding noise
    batch = padded if _fp64_finite(ref, padded) else dict(input_ids=ids, labels=ids)
    ref(**batch).loss.backward()
    model.backward(model(**batch).loss)
    assert_grads_match(ref, model, rerun=lambda m: m(**batch).loss)


@pytest.mark.parametrize("name,tp", RUNS, ids=[f"{n}-tp{t}" for n, t in RUNS])
def test_sequence_parallel_equals_hf(name, tp):
    harness.run(tp, check_equal_to_hf, name, tp)


@pytest.mark.parametrize("name,without_file", [("olmo", None), ("gpt_neox", "gpt_neox")],
                         ids=["olmo", "gpt_neox-file-removed"])
def test_automatic_plan_under_sequence_parallelism_equals_hf(name, without_file):
    harness.run(2, check_equal_to_hf, name, 2, without_file)


class _TokenMixingMLP(T.models.olmo.modeling_olmo.OlmoMLP):
    """OLMo's MLP followed by a running sum over the sequence: right on the whole sequence, wrong
    on a sequence shard."""

    def forward(self, x):
        return super().forward(x).cumsum(dim=1) / x.shape[1]


class _TokenMixingOlmo(T.OlmoForCausalLM):
    """An OLMo whose MLPs mix the tokens (built so in ``__init__``: the verification's proxy is
    built from the class)."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp.__class__ = _TokenMixingMLP


def check_refused(name):
    smp.init({"tensor_parallel_degree": 2, "sequence_parallel": True})
    model = _TokenMixingOlmo(_olmo().config) if name == "token_mixing" else _build(name, router_loss=True)
    with pytest.raises(NotImplementedError) as info:
        smp.DistributedModel(model)
    return str(info.value)


@pytest.mark.parametrize("name", list(MOE))
def test_router_loss_refused_naming_the_feature(name):
    for msg in harness.run(2, check_refused, name):
        assert msg.startswith("sequence_parallel for ") and "load-balancing loss (output_router_logits) is not " \
            "implemented" in msg, msg


def test_expert_parallelism_refused_naming_both():
    from modelparallel.config import build_config
    with pytest.raises(NotImplementedError, match="sequence_parallel with expert_parallel_degree 2"):
        build_config({"tensor_parallel_degree": 2, "expert_parallel_degree": 2, "sequence_parallel": True}, 4)


def test_automatic_plan_not_reproducing_it_refused_naming_the_feature():
    for msg in harness.run(2, check_refused, "token_mixing"):
        assert msg.startswith("sequence_parallel for _TokenMixingOlmo on the automatic tensor-parallel plan is not "
                              "implemented"), msg
