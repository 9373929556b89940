"""GPT-J, GPT-Neo and Llama plans cover their models and refuse degrees that would split a head
(one process, no collectives).

A failure means a plan in modelparallel/models/{gptj,gptneo,llama}.py matches the wrong modules,
misses a cached head count, or lacks a ``divisible_config`` entry; the walker's messages come
from modelparallel/tp/walker.py.
"""

from transformers import GPTJConfig, GPTJForCausalLM, GPTNeoConfig, GPTNeoForCausalLM, LlamaConfig, LlamaForCausalLM

from modelparallel.models import architecture_for
from modelparallel.tp.walker import collect

TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gptj(hidden=64, heads=4, vocab=1001):
    return GPTJForCausalLM(GPTJConfig(n_embd=hidden, n_layer=2, n_head=heads, rotary_dim=8, n_positions=16,
                                      vocab_size=vocab, **TOKENS))


def gptneo(hidden=64, heads=4, vocab=1001):
    return GPTNeoForCausalLM(GPTNeoConfig(hidden_size=hidden, num_layers=2, num_heads=heads, window_size=4,
                                          attention_types=[[["global", "local"], 1]], max_position_embeddings=16,
                                          vocab_size=vocab, **TOKENS))


def llama(hidden=64, heads=4, kv_heads=2, vocab=1001, tied=False):
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads,
                                        max_position_embeddings=16, vocab_size=vocab, tie_word_embeddings=tied,
                                        **TOKENS))


def _work(model, tp):
    return collect(model, architecture_for(model).spec, tp)


def _styles(work):
    return {a.path: a.style for a in work.assignments}


def test_gptj_plan_shards_every_block_linear_and_its_head_count():
    work = _work(gptj(), tp=4)
    assert not work.problems, work.problems
    styles = _styles(work)
    assert styles["transformer.h.1.attn.k_proj"] == "colwise" and styles["transformer.h.1.mlp.fc_out"] == "rowwise"
    assert styles["lm_head"] == "vocab_colwise" and styles["transformer.wte"] == "vocab_embedding"
    assert {(p, a, v) for p, _, a, v in work.rewrites} == {(f"transformer.h.{i}.attn", "num_attention_heads", 1)
                                                          for i in range(2)}


def test_gptneo_plan_covers_global_and_local_layers():
    work = _work(gptneo(), tp=2)
    assert not work.problems, work.problems
    styles = _styles(work)
    for i in range(2):  # layer 0 global, layer 1 local: the same plan
        assert styles[f"transformer.h.{i}.attn.attention.out_proj"] == "rowwise"
    assert ("transformer.h.1.attn.attention", "num_heads", 2) in {(p, a, v) for p, _, a, v in work.rewrites}


def test_llama_plan_needs_no_rewrites_tied_or_not():
    for tied in (False, True):
        work = _work(llama(tied=tied), tp=2)
        assert not work.problems, work.problems
        styles = _styles(work)
        assert styles["model.layers.1.mlp.gate_proj"] == styles["model.layers.1.mlp.up_proj"] == "colwise"
        assert styles["model.layers.1.mlp.down_proj"] == styles["model.layers.1.self_attn.o_proj"] == "rowwise"
        assert not work.rewrites


def test_llama_kv_heads_not_divisible_replicated_decided_by_config_not_k_proj_width():
    work = _work(llama(kv_heads=2), tp=4)  # k_proj has 2 x 16 = 32 outputs, divisible by 4
    assert not work.problems, work.problems
    styles = _styles(work)
    assert styles["model.layers.1.self_attn.k_proj"] == styles["model.layers.1.self_attn.v_proj"] == "kv_replicated"
    assert styles["model.layers.1.self_attn.q_proj"] == "colwise"
    assert {(p, a, v) for p, _, a, v in work.rewrites} == {(f"model.layers.{i}.self_attn", "num_key_value_groups", 1)
                                                          for i in range(2)}
    assert "kv_replicated" not in _styles(_work(llama(kv_heads=2), tp=2)).values()  # 2 divides 2: whole KV heads


def test_llama_heads_not_divisible_refused():
    work = _work(llama(hidden=96, heads=6, kv_heads=6), tp=4)  # q/k/v_proj's 96 outputs divide by 4
    assert work.problems == ["LlamaConfig.num_attention_heads = 6 is not divisible by tensor_parallel_degree 4 (each "
                             "rank must hold whole heads)"]
    assert not _work(llama(hidden=96, heads=6, kv_heads=6), tp=2).problems


def test_gptj_and_gptneo_heads_not_divisible_named_with_numbers():
    j = _work(gptj(hidden=96, heads=6), tp=4).problems
    assert "GPTJConfig.num_attention_heads = 6 is not divisible by tensor_parallel_degree 4 " \
           "(each rank must hold whole heads)" in j
    assert "transformer.h.0.attn.num_attention_heads = 6 is not divisible by tensor_parallel_degree 4" in j
    n = _work(gptneo(hidden=96, heads=6), tp=4).problems
    assert "transformer.h.1.attn.attention.num_heads = 6 is not divisible by tensor_parallel_degree 4" in n
    assert any(p.startswith("GPTNeoConfig.num_heads = 6 is not divisible") for p in n), n


def test_vocab_too_small_for_degree_named():
    for model, path in ((gptj(vocab=6), "transformer.wte"), (llama(vocab=6, tied=True), "model.embed_tokens")):
        problems = _work(model, tp=4).problems
        assert any(p.startswith(f"{path}: num_embeddings (vocabulary) = 6 is too small") for p in problems), problems
        assert any(p.startswith("lm_head: out_features (vocabulary) = 6 is too small") for p in problems), problems
