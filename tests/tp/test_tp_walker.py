"""The plan walker refuses bad plans before touching a tensor (one process, no collectives).

A failure means modelparallel/tp/walker.py or tp/plan.py let a plan through that would shard
wrongly, or refused a good one.
"""

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from modelparallel.models import architecture_for
from modelparallel.tp.plan import ArchSpec, ModulePlan, glob_match, to_glob
from modelparallel.tp.walker import collect


def gpt2(**kw):
    base = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=16)
    return GPT2LMHeadModel(GPT2Config(**{**base, **kw}))


def test_globs_replace_whole_segments_only():
    assert to_glob("transformer.h.11.mlp.w1") == "transformer.h.*.mlp.w1"
    assert glob_match("h.*.attn", "h.3.attn") and not glob_match("h.*.attn", "h.3.attn.c_attn")
    assert not glob_match("h.*.w1", "h.3.w12")


def test_gpt2_plan_covers_every_block_linear():
    work = collect(gpt2(), architecture_for(gpt2()).spec, tp=2)
    assert not work.problems
    assert {a.path for a in work.assignments} >= {"transformer.wte", "lm_head", "transformer.h.1.attn.c_attn"}
    assert ("transformer.h.0.attn", "num_heads", 2) in {(p, a, v) for p, _, a, v in work.rewrites}


def test_heads_not_divisible_named_with_numbers():
    model = gpt2(n_embd=96, n_head=6)
    work = collect(model, architecture_for(model).spec, tp=4)
    assert "transformer.h.0.attn.num_heads = 6 is not divisible by tensor_parallel_degree 4" in work.problems


def test_hidden_not_divisible_named():
    model = gpt2(n_embd=66, n_head=3, n_inner=129)
    work = collect(model, architecture_for(model).spec, tp=2)
    assert any("transformer.h.0.mlp.c_fc: out_features = 129 is not divisible by tensor_parallel_degree 2" in p
               for p in work.problems), work.problems


def test_vocab_too_small_for_degree():
    model = gpt2(vocab_size=6)
    work = collect(model, architecture_for(model).spec, tp=4)
    assert any("transformer.wte: num_embeddings (vocabulary) = 6 is too small" in p for p in work.problems)


def test_rule_matching_nothing_refused():
    rules = architecture_for(gpt2()).spec.base.rules
    spec = ArchSpec("gpt2", base=ModulePlan(rules={**rules, "h.*.attn.c_atn": "colwise"},
                                            packed={"h.*.attn.c_attn": 3}))
    work = collect(gpt2(), spec, tp=2)
    assert any("rule 'h.*.attn.c_atn' -> 'colwise' matches no module" in p for p in work.problems)


def test_uncovered_linear_inside_block_refused():
    model = gpt2(add_cross_attention=True)
    work = collect(model, architecture_for(model).spec, tp=2)
    assert any("transformer.h.0.crossattention.c_attn (Conv1D) is inside a planned block" in p
               for p in work.problems), work.problems


def test_style_on_wrong_module_type_refused():
    rules = architecture_for(gpt2()).spec.base.rules
    spec = ArchSpec("gpt2", base=ModulePlan(rules={**rules, "h.*.ln_1": "colwise"},
                                            packed={"h.*.attn.c_attn": 3}))
    work = collect(gpt2(), spec, tp=2)
    assert "transformer.h.0.ln_1: style 'colwise' cannot shard a LayerNorm" in work.problems
