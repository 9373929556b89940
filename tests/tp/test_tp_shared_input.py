"""Shared-input rules (``ModulePlan.shared_inputs``) are checked by the walker before any tensor
is touched (one process, no collectives).

A failure means modelparallel/tp/walker.py (``_collect_shared``) let a shared-input rule through
that would skip an input all-reduce wrongly, or refused a good one. The collective counts the rule
buys are checked in tests/models (test_causal_lms, test_bert): 2 input all-reduces per layer
backward, not one per q, k, v, gate and up.
"""

from dataclasses import replace

from transformers import LlamaConfig, LlamaForCausalLM

from modelparallel.models import architecture_for
from modelparallel.tp.plan import SharedInput
from modelparallel.tp.walker import collect


def llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100))


def with_shared(model, shared):
    spec = architecture_for(model).spec
    return replace(spec, base=replace(spec.base, shared_inputs=shared))


def test_llama_plan_shares_attention_and_mlp_inputs():
    model = llama()
    work = collect(model, architecture_for(model).spec, tp=2)
    assert not work.problems
    assert {p for p, _, _ in work.shared} == {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn", "mlp")}


def test_unknown_argument_refused_with_module_path():
    model = llama()
    work = collect(model, with_shared(model, {"layers.*.mlp": SharedInput(arg="hidden")}), tp=2)
    assert "model.layers.0.mlp: LlamaMLP.forward has no argument 'hidden'" in work.problems


def test_rule_without_column_parallel_layer_below_refused():
    model = llama()
    work = collect(model, with_shared(model, {"layers.*.input_layernorm": SharedInput(arg="hidden_states")}), tp=2)
    assert "model.layers.0.input_layernorm: shared input rule but no column-parallel layer below it" in work.problems


def test_rule_matching_nothing_and_missing_child_refused():
    model = llama()
    work = collect(model, with_shared(model, {"blocks.*": SharedInput(arg="x"),
                                              "layers.*": SharedInput(output_of="ln_1")}), tp=2)
    assert "shared input rule 'blocks.*' matches no module" in work.problems
    assert "model.layers.1: no child 'ln_1' for the shared input" in work.problems
