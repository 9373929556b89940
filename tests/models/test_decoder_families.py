"""GPT-NeoX, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2, OPT and Falcon under tensor parallelism equal
single-process Hugging Face at TP 2 and 4: logits, loss and every gradient with a padded batch,
three AdamW steps, greedy generation; and at TP 2 their checkpoints are Hugging Face's (the
export of ``state_dict()`` equals what ``save_pretrained`` writes, key for key; ``save_pretrained``
output loads shard by shard into a meta-built model; a full checkpoint loads with
``from_pretrained``).

A failure names the family; look first at which quantity differs. Logits of one family ->
its file in modelparallel/models/ (a rule, a per-rank head count, a fused layout). Gradients of
per-head norms only (Qwen3) -> the ``replicated_grad_sum`` style (tp/replicated.py). Gradients of
k/v only at TP 4 (Qwen2, Gemma: fewer KV heads than ranks) -> KV-head replication
(tp/replicated.py, tp/kv_heads.py). Keys or values of the exports -> the family's ``TABLE``.
"""

import copy

import pytest
import torch
import transformers as T

import harness
import modelparallel as smp
from modelparallel.models import table_for
from modelparallel.models._translate import to_hf
from reference import assert_close, assert_grads_match, assert_same_training, build_pair

VOCAB = 101  # uneven vocabulary shards at TP 2 and 4
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SMALL = dict(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=32, **TOKENS)


def _eager(config):
    config._attn_implementation = "eager"
    return config


FAMILIES = {  # name -> (model class, config factory)
    # partial rotary (a quarter of each head), parallel residual, untied head stored as embed_out
    "gpt_neox": (T.GPTNeoXForCausalLM, lambda: T.GPTNeoXConfig(
        num_attention_heads=4, intermediate_size=128, rotary_pct=0.25, **SMALL)),
    # sequential residual, tied head
    "gpt_neox_tied": (T.GPTNeoXForCausalLM, lambda: T.GPTNeoXConfig(
        num_attention_heads=4, intermediate_size=128, use_parallel_residual=False, tie_word_embeddings=True,
        **SMALL)),
    # biases on q, k and v only; 2 KV heads: replicated at TP 4
    "qwen2": (T.Qwen2ForCausalLM, lambda: _eager(T.Qwen2Config(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, **SMALL))),
    # per-head q/k norms, sdpa
    "qwen3": (T.Qwen3ForCausalLM, lambda: T.Qwen3Config(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, **SMALL)),
    # fused qkv and gate_up, partial rotary
    "phi3": (T.Phi3ForCausalLM, lambda: _eager(T.Phi3Config(
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, partial_rotary_factor=0.5, **SMALL))),
    # scaled embedding, tied head, one KV head (multi-query): replicated at TP 2 and 4
    "gemma": (T.GemmaForCausalLM, lambda: _eager(T.GemmaConfig(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=128, **SMALL))),
    # attention and final logit soft-capping, sliding window (4 < sequence 12) on alternate layers
    "gemma2": (T.Gemma2ForCausalLM, lambda: _eager(T.Gemma2Config(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=4,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **SMALL))),
    # fc1/fc2 in the layer, project_in/out (embeddings 32 wide), learned positions, tied head
    "opt": (T.OPTForCausalLM, lambda: _eager(T.OPTConfig(
        num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=32, dropout=0.0, **SMALL))),
    # new decoder architecture: [KV groups, queries + k + v, head_dim] fused, two parallel LayerNorms
    "falcon": (T.FalconForCausalLM, lambda: _eager(T.FalconConfig(
        num_attention_heads=8, num_kv_heads=4, new_decoder_architecture=True, bias=True, **SMALL))),
    # multi-head, [heads, 3, head_dim] fused, sequential blocks, untied head
    "falcon_mha": (T.FalconForCausalLM, lambda: _eager(T.FalconConfig(
        num_attention_heads=4, multi_query=False, parallel_attn=False, tie_word_embeddings=False, **SMALL))),
}
CASES = [(name, tp) for name in FAMILIES for tp in (2, 4)]


def _batch(seed=1, pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, :3] = 0  # left padding in the second row
    return ids, mask


def _pair(name, tp):
    cls, config = FAMILIES[name]
    return build_pair(cls, config(), tp)


def _fp64_finite(ref, kwargs) -> bool:
    """Whether an fp64 copy of ``ref`` computes a finite loss on ``kwargs`` (OPT's padding mask,
    built for fp32, gives NaN in fp64): the gradient check measures fp32 rounding noise with it."""
    with torch.no_grad():
        return bool(torch.isfinite(copy.deepcopy(ref).double()(**kwargs).loss))


def check_family(name, tp):
    """Logits, loss, gradients (padded batch), generation and three AdamW steps against HF."""
    ref, model = _pair(name, tp)
    # HF's names; a packed weight holds its chunks as their own dimension (same elements)
    assert {k: v.numel() for k, v in model.state_dict().items()} == {k: v.numel() for k, v in ref.state_dict().items()}
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
    want, got = ref(**padded), model(**padded)
    assert_close(got.logits, want.logits, what=f"{name} logits")
    assert_close(got.loss, want.loss, what=f"{name} loss")
    batch = padded if _fp64_finite(ref, padded) else dict(input_ids=ids, labels=ids)
    ref(**batch).loss.backward()
    model.backward(model(**batch).loss)
    assert_grads_match(ref, model, rerun=lambda m: m(**batch).loss)
    tied = ref.lm_head.weight is ref.get_input_embeddings().weight
    assert (model.module.lm_head.weight is model.module.get_input_embeddings().weight) == tied, f"{name}: tie"
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=mask)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw)), f"{name}: greedy generation differs"
    ref, model = _pair(name, tp)
    batches = [_batch(seed=100 + step, pad=False)[0] for step in range(3)]
    assert_same_training(ref, model, [dict(input_ids=ids, labels=ids) for ids in batches], what=f"{name} ")


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_family_equals_hf(name, tp):
    harness.run(tp, check_family, name, tp)


def check_checkpoints(name, directory):
    """At TP 2: the HF export of ``state_dict()`` is what ``save_pretrained`` wrote; a meta-built
    model reads that directory shard by shard; a full checkpoint loads with ``from_pretrained``."""
    from safetensors.torch import load_file

    ref, model = _pair(name, 2)
    ids, _ = _batch(pad=False)
    if smp.rank() == 0:
        ref.save_pretrained(f"{directory}/hf")
    smp.barrier()
    stored = load_file(f"{directory}/hf/model.safetensors")
    exported = to_hf(table_for(ref.config.model_type), model.state_dict())
    assert exported.keys() >= stored.keys(), sorted(set(stored) - set(exported))
    for key, value in stored.items():
        assert torch.equal(exported[key], value), key
    cls, config = FAMILIES[name]
    with torch.device("meta"):
        meta_model = cls(config())
    meta_model = smp.DistributedModel(meta_model)
    smp.load_hf_checkpoint(meta_model, f"{directory}/hf")
    want = ref(ids).logits
    assert_close(meta_model(ids).logits, want, what=f"{name} after shard-on-read")
    smp.save_checkpoint(f"{directory}/full", "final", partial=False, model=model)
    loaded, info = cls.from_pretrained(f"{directory}/full/final", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_close(loaded(ids).logits, want, what=f"{name} from its full checkpoint")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_checkpoints_are_hugging_face_directories(name, tmp_path):
    harness.run(2, check_checkpoints, name, str(tmp_path))


def check_refused(config, tp):
    smp.init({"tensor_parallel_degree": tp})
    with pytest.raises(NotImplementedError) as info:
        smp.DistributedModel(T.AutoModelForCausalLM.from_config(config))
    return str(info.value)


def test_unsupported_configurations_refused_naming_the_feature():
    falcon_alibi = T.FalconConfig(num_attention_heads=4, alibi=True, multi_query=False, **SMALL)
    falcon_mqa = T.FalconConfig(num_attention_heads=4, multi_query=True, **SMALL)
    phi3_gqa = T.Phi3Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, **SMALL)
    messages = [harness.run(2, check_refused, c, 2)[0] for c in (falcon_alibi, falcon_mqa, phi3_gqa)]
    assert "ALiBi position biases is not supported" in messages[0] and "alibi=True" in messages[0], messages[0]
    assert "multi-query attention" in messages[1] and "multi_query=True" in messages[1], messages[1]
    assert "grouped-query attention in a fused qkv_proj" in messages[2], messages[2]
    assert "num_attention_heads=4, num_key_value_heads=2" in messages[2], messages[2]


def test_bad_input_named_by_the_plan_check():
    """One process: what the walker refuses in a built-in family before touching a tensor."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from modelparallel.models import architecture_for
    from modelparallel.tp.walker import collect

    AttentionInterface.register("my_kernel", sdpa_attention_forward)  # may read global head counts
    config = FAMILIES["qwen2"][1]()
    config._attn_implementation = "my_kernel"
    model = T.Qwen2ForCausalLM(config)
    assert collect(model, architecture_for(model).spec, 2).problems == [
        "model.layers.*.self_attn: attention implementation 'my_kernel' is not one known to compute head by head "
        "(eager, sdpa, flex_attention, flash_attention_*)"]
    model = T.Qwen2ForCausalLM(FAMILIES["qwen2"][1]())
    model.model.embed_tokens = torch.nn.Embedding(64, VOCAB)  # hidden x vocabulary
    problems = collect(model, architecture_for(model).spec, 2).problems
    assert "model.embed_tokens: its first dimension (64) is not the vocabulary (Qwen2Config.vocab_size = 101)" \
        in problems, problems
    heads = T.Qwen2ForCausalLM(T.Qwen2Config(**{**SMALL, "hidden_size": 96}, num_attention_heads=6,
                                             num_key_value_heads=6, intermediate_size=128))
    assert collect(heads, architecture_for(heads).spec, 4).problems == [
        "Qwen2Config.num_attention_heads = 6 is not divisible by tensor_parallel_degree 4 (each rank must hold "
        "whole heads)"]
