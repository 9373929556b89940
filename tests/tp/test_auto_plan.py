"""The automatic plan (modelparallel/tp/auto/): every built-in family with its model file removed
gets the same shards and results as the file; models with no file at all train exactly; what it
cannot place is refused naming the module; a wrong plan does not pass its verification.

Where to look first. Shards differ from a family's file: the derivation (tp/auto/structure.py
finds the pairs and chunking from the probe's autograd graph; tp/auto/derive.py chooses layouts
and per-rank sizes). Shards equal but numbers differ: the plan's assembly (tp/auto/plan.py:
shared inputs, KV rules) or the verification missed it (tp/auto/verify.py). A refusal test
failing: the module named in the message is the one the check should have caught.
"""

import copy

import pytest
import torch
import transformers as T
from torch.distributed.tensor import DTensor

import harness
import modelparallel as smp
import modelparallel.models as registry
from registry_helpers import FileRemoved
from modelparallel.tp.auto.plan import AutoPlanError, derive
from modelparallel.tp.auto.verify import verify
from modelparallel.tp.walker import collect, parallelize
from reference import assert_close, assert_grads_match, build_pair

VOCAB = 101
S = dict(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=32, pad_token_id=0,
         bos_token_id=1, eos_token_id=2)


def _eager(config):
    config._attn_implementation = "eager"
    return config


FAMILIES = {  # every built-in family: (model class, config factory, degrees)
    "gpt2": (T.GPT2LMHeadModel, lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32,
                                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), (2, 4)),
    "gptj": (T.GPTJForCausalLM, lambda: T.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=32,
                                                     vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                                     attn_pdrop=0.0), (2, 4)),
    "gpt_neo": (T.GPTNeoForCausalLM, lambda: T.GPTNeoConfig(
        hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=4,
        max_position_embeddings=32, vocab_size=VOCAB, resid_dropout=0.0, embed_dropout=0.0,
        attention_dropout=0.0), (2, 4)),
    "llama": (T.LlamaForCausalLM, lambda: _eager(T.LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                                               intermediate_size=128, **S)), (2, 4)),
    "mistral": (T.MistralForCausalLM, lambda: _eager(T.MistralConfig(num_attention_heads=4, num_key_value_heads=2,
                                                                     intermediate_size=128, sliding_window=4, **S)),
                (2,)),
    "bert": (T.BertForMaskedLM, lambda: T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=128, vocab_size=VOCAB,
                                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             (2,)),
    "roberta": (T.RobertaForMaskedLM, lambda: T.RobertaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1), (2,)),
    "gpt_neox": (T.GPTNeoXForCausalLM, lambda: T.GPTNeoXConfig(num_attention_heads=4, intermediate_size=128,
                                                               rotary_pct=0.25, **S), (2, 4)),
    "qwen2": (T.Qwen2ForCausalLM, lambda: _eager(T.Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                                                               intermediate_size=128, **S)), (2, 4)),
    "qwen3": (T.Qwen3ForCausalLM, lambda: T.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                        intermediate_size=128, **S), (2, 4)),
    "phi3": (T.Phi3ForCausalLM, lambda: _eager(T.Phi3Config(num_attention_heads=4, num_key_value_heads=4,
                                                            intermediate_size=128, partial_rotary_factor=0.5, **S)),
             (2, 4)),
    "gemma": (T.GemmaForCausalLM, lambda: _eager(T.GemmaConfig(num_attention_heads=4, num_key_value_heads=1,
                                                               head_dim=16, intermediate_size=128, **S)), (2, 4)),
    "gemma2": (T.Gemma2ForCausalLM, lambda: _eager(T.Gemma2Config(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=4,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **S)), (2,)),
    "opt": (T.OPTForCausalLM, lambda: _eager(T.OPTConfig(num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=32,
                                                         dropout=0.0, **S)), (2, 4)),
    "falcon": (T.FalconForCausalLM, lambda: _eager(T.FalconConfig(num_attention_heads=8, num_kv_heads=4,
                                                                  new_decoder_architecture=True, bias=True, **S)),
               (2, 4)),
}
SHARD_CASES = [(name, tp) for name, (_, _, degrees) in FAMILIES.items() for tp in degrees]


def _shards(work):
    return {a.path: (a.style, a.chunks) for a in work.assignments}


@pytest.mark.parametrize("name,tp", SHARD_CASES, ids=[f"{n}-tp{t}" for n, t in SHARD_CASES])
def test_automatic_plan_gives_each_family_the_shards_of_its_file(name, tp):
    cls, config, _ = FAMILIES[name]
    model = cls(config())
    spec = derive(model, tp).spec
    auto, builtin = collect(model, spec, tp), collect(model, registry.BUILT_IN[model.config.model_type].spec, tp)
    assert not auto.problems, auto.problems
    assert _shards(auto) == _shards(builtin)
    # the sizes it makes per rank are among the file's: those the forward reads (GPT-2's split_size;
    # the file also rewrites num_heads and embed_dim, which GPT2Attention.forward does not read)
    assert {(p, a, v) for p, _, a, v in auto.rewrites} <= {(p, a, v) for p, _, a, v in builtin.rewrites}


def check_results_without_the_file(name, tp):
    """With its file removed, the family trains exactly like one process, in shards of the same
    local shapes as with the file."""
    cls, config, _ = FAMILIES[name]
    with FileRemoved(config().model_type):
        ref, model = build_pair(cls, config(), tp)
    _, with_file = build_pair(cls, config(), tp)
    local = lambda m: {k: tuple((v.to_local() if isinstance(v, DTensor) else v).shape)
                       for k, v in m.module.state_dict(keep_vars=True).items()}
    assert local(model) == local(with_file)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    want, got = ref(ids, labels=ids), model(ids, labels=ids)
    assert_close(got.logits, want.logits, what=f"{name} logits")
    assert_close(got.loss, want.loss, what=f"{name} loss")
    want.loss.backward()
    model.backward(got.loss)
    assert_grads_match(ref, model, rerun=lambda m: m(ids, labels=ids).loss)


RESULT_CASES = [(name, 2) for name in FAMILIES] + [("qwen2", 4), ("gemma", 4)]  # KV heads replicated at 4


@pytest.mark.parametrize("name,tp", RESULT_CASES, ids=[f"{n}-tp{t}" for n, t in RESULT_CASES])
def test_family_with_its_file_removed_equals_one_process(name, tp):
    harness.run(tp, check_results_without_the_file, name, tp)


def _olmo(**kw):
    return T.OlmoConfig(**{**dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, **S), **kw})


class _LayerNormedMLP(torch.nn.Module):
    """An MLP normalizing its hidden features between the two layers: no column/row split of it
    computes the same thing (the norm needs every feature)."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.up, self.norm, self.down = torch.nn.Linear(hidden, inner), torch.nn.LayerNorm(inner), \
            torch.nn.Linear(inner, hidden)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


class _NormedMLPForCausalLM(T.OlmoForCausalLM):
    """An OLMo whose MLPs normalize between their layers: an architecture no split fits."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = _LayerNormedMLP(config.hidden_size, config.intermediate_size)


def _unrecognisable():
    return _NormedMLPForCausalLM(_olmo())


def _changed_after_construction():
    model = T.OlmoForCausalLM(_olmo())
    model.model.layers[1].mlp = _LayerNormedMLP(64, 128)
    return model


def _refusal(build, tp=2):
    with pytest.raises(AutoPlanError) as info:
        derive(build(), tp)
    return str(info.value)


def test_unrecognisable_models_refused_naming_the_module():
    msg = _refusal(_unrecognisable)
    assert msg.startswith("model.layers.0.mlp: no split of model.layers.0.mlp.up -> model.layers.0.mlp.down over 2 "
                          "ranks reproduces its output"), msg
    # OLMo2 normalizes q and k over all heads together (q_norm over 4 x 16 features)
    msg = _refusal(lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**_olmo().to_dict())))
    assert msg.startswith("model.layers.0.self_attn: no split of"), msg
    # BLOOM's ALiBi biases are built for all heads outside the attention module
    msg = _refusal(lambda: T.BloomForCausalLM(T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)))
    assert msg.startswith("transformer.h.0.self_attention: no split of"), msg
    # a model with no repeated blocks
    msg = _refusal(lambda: T.OlmoForCausalLM(_olmo(num_hidden_layers=0)))
    assert "OlmoForCausalLM: no repeated blocks" in msg, msg
    # the plan is found on a model its class builds from its config: one changed afterwards is refused
    msg = _refusal(_changed_after_construction)
    assert msg.startswith("model.layers.1.mlp: _LayerNormedMLP, where OlmoForCausalLM(config) builds OlmoMLP"), msg


def _bad_embedding():
    model = T.OlmoForCausalLM(_olmo())
    model.model.embed_tokens = torch.nn.Embedding(64, VOCAB)  # hidden x vocabulary: the vocabulary is not dim 0
    return model


def _custom_attention():
    """An OLMo running a user-registered attention function (which may read global head counts)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("my_kernel", sdpa_attention_forward)
    config = _olmo()
    config._attn_implementation = "my_kernel"
    return T.OlmoForCausalLM(config)


def test_bad_input_refused_naming_the_module_or_config_entry():
    assert _refusal(lambda: T.OlmoForCausalLM(_olmo(hidden_size=96, num_attention_heads=6, num_key_value_heads=6)),
                    4) == ("OlmoConfig.num_attention_heads = 6 is not divisible by tensor_parallel_degree 4 (each "
                           "rank must hold whole heads)")
    msg = _refusal(_bad_embedding)
    assert msg == ("OlmoForCausalLM.model.embed_tokens: its first dimension (64) is not the vocabulary "
                   "(OlmoConfig.vocab_size = 101); its weight is (64, 101)"), msg
    msg = _refusal(_custom_attention)
    assert msg.startswith("model.layers.*.self_attn: attention implementation 'my_kernel' is not one known"), msg


def check_entry_points(directory):
    """An architecture with no file, through each entry point: a meta build marked for tensor
    parallelism (wrapped with meta as the default device: the plan's proxy must still be real)
    and read shard by shard, and ``transform``; both equal HF."""
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    ref = T.OlmoForCausalLM(_olmo()).eval()
    if smp.rank() == 0:
        ref.save_pretrained(f"{directory}/hf")
    smp.barrier()
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    want = ref(ids).logits
    with smp.tensor_parallelism(), torch.device("meta"):  # wrapped under meta too, as the CLI does
        meta_model = smp.DistributedModel(T.OlmoForCausalLM(_olmo()))
    assert isinstance(meta_model.module.model.layers[0].mlp.up_proj.weight, DTensor)
    smp.load_hf_checkpoint(meta_model, f"{directory}/hf")
    assert_close(meta_model(ids).logits, want, what="meta build + load_hf_checkpoint")
    transformed = smp.transform(copy.deepcopy(ref))
    assert isinstance(transformed.model.layers[0].self_attn.o_proj.weight, DTensor)
    assert_close(transformed(ids).logits, want, what="transform")


def test_entry_points_use_the_automatic_plan(tmp_path):
    harness.run(2, check_entry_points, str(tmp_path))


def check_refused_on_every_rank():
    smp.init({"tensor_parallel_degree": 2})
    with pytest.raises(AutoPlanError) as info:
        smp.DistributedModel(_unrecognisable())
    return str(info.value)


def test_refusal_reaches_every_rank_before_any_collective():
    first, second = harness.run(2, check_refused_on_every_rank)
    assert first == second and first.startswith("model.layers.0.mlp: no split of"), first


def check_verification_refuses_a_wrong_plan():
    """Llama's plan with q_proj cut as two packed chunks (rank 0 gets heads 0 and 2 where k and
    v give it KV head 0): it runs, and computes something else."""
    from dataclasses import replace

    from modelparallel.tp.plan import Packed

    smp.init({"tensor_parallel_degree": 2})
    model = T.LlamaForCausalLM(_eager(T.LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                                    intermediate_size=128, **S)))
    good = registry.BUILT_IN["llama"].spec
    rules = {**good.base.rules, "layers.*.self_attn.q_proj": "packed_colwise"}
    wrong = replace(good, base=replace(good.base, rules=rules, packed={"layers.*.self_attn.q_proj": Packed(2)}))
    mesh = smp.tp_mesh()
    assert verify(model, good, mesh, parallelize) is None
    found = verify(model, wrong, mesh, parallelize)
    return found.what


def test_verification_refuses_a_plan_that_computes_something_else():
    what, other = harness.run(2, check_verification_refuses_a_wrong_plan)
    assert what == other and what.startswith("logits") and "model.layers.0.self_attn" in what, what
