"""Architecture records (modelparallel/models/): a record registered from outside the package
shards a model exactly like one process at TP=2; every built-in record agrees with transformers'
own ``base_model_tp_plan`` / ``base_model_pp_plan`` where both exist; a model with no record
gets transformers' plans first.

Where to look first. The registered model differs from HF: ``architecture_for`` did not return
the registered record (models/__init__.py) or the walker did not apply its plan. A disagreement
with HF's plan: the record's file in models/, unless the difference is a deliberate one (then
name it in DIFFERENCES with the reason). A model with no record not sharded by HF's plan:
tp/auto/hf_plan.py (``candidate``) and tp/auto/__init__.py (``automatic_spec``).
"""

from dataclasses import replace

import pytest
import torch
import transformers as T
from torch.distributed.tensor import DTensor
from transformers import CONFIG_MAPPING

import harness
import modelparallel as smp
from modelparallel.models import BUILT_IN, Architecture, architecture_for, register_architecture
from modelparallel.pipeline.split import PipelineSplit, hf_pipeline_split
from modelparallel.tp.auto.hf_plan import candidate
from reference import assert_close, assert_grads_match, assert_same_training, build_pair

VOCAB = 101


class TinyConfig(T.LlamaConfig):
    """An architecture modelparallel has no file for (its own ``model_type``)."""

    model_type = "tiny_custom"
    base_model_tp_plan = None  # nothing from transformers to fall back on: the registered record alone


class TinyForCausalLM(T.LlamaForCausalLM):
    config_class = TinyConfig


def _tiny_config():
    config = TinyConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return config


def tiny_record() -> Architecture:
    """Llama's attention plan, the MLP kept whole on purpose: a plan no other source would give,
    so the shards show it was this record that applied."""
    llama = BUILT_IN["llama"]
    rules = {g: s for g, s in llama.spec.base.rules.items() if not g.startswith("layers.*.mlp")}
    base = replace(llama.spec.base, rules=rules, shared_inputs={"layers.*.self_attn": llama.spec.base.shared_inputs[
        "layers.*.self_attn"]}, replicated=("layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj"))
    spec = replace(llama.spec, model_type="tiny_custom", base=base)
    return Architecture(spec, replace(llama.table, arch="tiny_custom"), pipeline=llama.pipeline)


def check_registered(tp):
    register_architecture(TinyConfig, tiny_record())  # in every process, before wrapping
    ref, model = build_pair(TinyForCausalLM, _tiny_config(), tp)
    layer = model.module.model.layers[0]
    assert layer.self_attn.q_proj.weight.to_local().shape == (32, 64), "the record's attention rules did not apply"
    gate = layer.mlp.gate_proj.weight
    assert (gate.to_local() if isinstance(gate, DTensor) else gate).shape == (128, 64), "the MLP was sharded"
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    want, got = ref(ids, labels=ids), model(ids, labels=ids)
    assert_close(got.logits, want.logits, what="registered logits")
    assert_close(got.loss, want.loss, what="registered loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model, rerun=lambda m: m(ids, labels=ids).loss)
    ref, model = build_pair(TinyForCausalLM, _tiny_config(), tp)
    batches = [dict(input_ids=b, labels=b) for b in
               torch.randint(3, VOCAB, (3, 2, 12), generator=torch.Generator().manual_seed(2))]
    assert_same_training(ref, model, batches, what="registered ")


def test_registered_architecture_equals_one_process_at_tp2():
    harness.run(2, check_registered, 2)


def test_registered_record_is_found_for_its_config_class_only():
    record = tiny_record()
    register_architecture(TinyConfig, record)
    config = _tiny_config()
    assert architecture_for(config) is record and architecture_for(TinyForCausalLM(config)) is record
    assert architecture_for(T.LlamaConfig()) is BUILT_IN["llama"], "the base class keeps its own record"


def test_register_refuses_a_mismatched_record():
    with pytest.raises(ValueError, match="model_type"):
        register_architecture(T.GPT2Config, tiny_record())
    with pytest.raises(TypeError, match="Architecture"):
        register_architecture(TinyConfig, tiny_record().spec)
    with pytest.raises(TypeError, match="Architecture.table"):
        Architecture(tiny_record().spec, table=tiny_record().pipeline)
    assert smp.register_architecture is register_architecture and smp.Architecture is Architecture


# ---- agreement with transformers' own plans ---------------------------------------------------

KIND = {"colwise": "column", "packed_colwise": "column", "colwise_gather_output": "column",
        "vocab_embedding": "vocabulary", "rowwise": "row", "rowwise_split_input": "row",
        "replicated_with_grad_allreduce": "replicated, gradient summed", "replicated_grad_sum":
        "replicated, gradient summed", "moe_tp_experts": "experts"}
"""Both libraries' style names by what they do to a module's weight."""

DIFFERENCES = {
    ("*", "embed_tokens"): "ours shards the token embedding over the vocabulary; HF's base plan keeps it whole",
    ("gpt_neox", "embed_in"): "ours shards the token embedding over the vocabulary; HF's base plan keeps it whole",
    **{(t, f"layers.*.mlp.experts{m}"): "HF shards the experts over the TP ranks; ours keeps them whole there "
                                        "(expert parallelism shards them)"
       for t in ("mixtral", "qwen2_moe") for m in ("", ".gate_up_proj", ".down_proj")},
    **{("qwen2_moe", f"layers.*.mlp.shared_expert.{m}"): "ours shards the shared expert (a dense MLP) as a Megatron "
                                                        "pair; HF keeps it whole"
       for m in ("gate_proj", "up_proj", "down_proj")},
}
"""Deliberate differences: (model_type or ``*``, module glob) -> why. Not differences of kind,
so not listed: Phi-3's fused projections, column then row in both, where HF gathers the
activation between them (``colwise_gather_output`` / ``rowwise_split_input``) and ours shards
inside each fused chunk and keeps it sharded; and sequence parallelism, which is no rule in
either plan (ours applies it from the config)."""


def _disagreements(model_type: str, hf: dict[str, str], ours: dict[str, str]) -> dict[str, tuple]:
    return {g: (hf.get(g), ours.get(g)) for g in set(hf) | set(ours)
            if KIND.get(hf.get(g)) != KIND.get(ours.get(g))}


def _hf_tp_plans():
    return {t: (dict(CONFIG_MAPPING[t].base_model_tp_plan), a) for t, a in BUILT_IN.items()
            if getattr(CONFIG_MAPPING[t], "base_model_tp_plan", None)}


def test_every_record_agrees_with_transformers_tp_plan():
    """'Agrees': every module either plan names gets the same kind of sharding in both (column:
    output split over the ranks, row: input split and output summed, replicated with the
    gradient summed, experts), HF's ``base_model_tp_plan`` against our record's base-model
    rules, module globs compared as written. Every other case is named in DIFFERENCES, and each
    named difference must still be one (the list cannot outlive the plans)."""
    plans = _hf_tp_plans()
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "mixtral"} <= set(plans)
    used = set()
    for model_type, (hf, record) in plans.items():
        for glob, (theirs, mine) in _disagreements(model_type, hf, record.spec.base.rules).items():
            key = (model_type, glob) if (model_type, glob) in DIFFERENCES else ("*", glob)
            assert key in DIFFERENCES, f"{model_type}: {glob} is {theirs!r} in HF's plan, {mine!r} in ours"
            used.add(key)
    assert used == set(DIFFERENCES), f"named differences that are none: {set(DIFFERENCES) - used}"


def test_every_pipeline_split_agrees_with_transformers_pp_plan():
    """'Agrees': the same list of blocks, and the same modules with parameters before it (first
    stage) and after it (last stage), in HF's ``base_model_pp_plan`` order."""
    compared = []
    for model_type, record in BUILT_IN.items():
        config = CONFIG_MAPPING[model_type]
        if record.pipeline is None or not getattr(config, "base_model_pp_plan", None):
            continue
        model = _tiny_of(model_type)
        assert hf_pipeline_split(model) == record.pipeline, model_type
        compared.append(model_type)
    assert {"llama", "mistral", "mixtral", "qwen2_moe"} <= set(compared)


def _tiny_of(model_type: str):
    cls = {"llama": T.LlamaForCausalLM, "mistral": T.MistralForCausalLM, "mixtral": T.MixtralForCausalLM,
           "qwen2_moe": T.Qwen2MoeForCausalLM}[model_type]
    moe = {"num_local_experts": 2, "num_experts": 2, "moe_intermediate_size": 16,
           "shared_expert_intermediate_size": 16} if model_type in ("mixtral", "qwen2_moe") else {}
    config = CONFIG_MAPPING[model_type](hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB, **moe)
    return cls(config)


def test_a_model_with_no_record_gets_transformers_plans_as_candidates():
    model = T.OlmoForCausalLM(T.OlmoConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2))
    assert architecture_for(model) is None
    spec = candidate(model, 2)
    assert spec.base.rules == {"embed_tokens": "vocab_embedding", **T.OlmoConfig.base_model_tp_plan}
    assert spec.head.rules == {"lm_head": "vocab_colwise"}
    # OLMo's final LayerNorm holds no parameters: it runs on every stage, as a rotary table does
    assert hf_pipeline_split(model) == PipelineSplit(blocks="layers", first=("embed_tokens",), last=())
    assert candidate(T.Phi3ForCausalLM(T.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, vocab_size=VOCAB, pad_token_id=0,
                                                     bos_token_id=1, eos_token_id=2)), 2) is None, \
        "a plan with styles ours does not share (colwise_gather_output) is no candidate"


def check_candidate_used(tp):
    from modelparallel.tp import auto, walker

    smp.init({"tensor_parallel_degree": tp, "prescaled_batch": True})
    config = T.OlmoConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)
    model = T.OlmoForCausalLM(config)
    return auto.plan_for(model, None, smp.tp_mesh(), walker.parallelize) == candidate(model, tp)


def test_transformers_plan_is_the_automatic_plan_where_it_verifies():
    assert all(harness.run(2, check_candidate_used, 2))
