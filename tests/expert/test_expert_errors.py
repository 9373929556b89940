"""Bad input to expert parallelism fails with one clear error on every rank, never a hang:
experts the degree does not divide, a degree the world does not allow, a model whose expert
layout is not built in, ``smp_moe=False`` with a degree > 1, expert with context parallelism,
and a routing that fails on one rank.

Where to look: modelparallel/expert/parallelize.py (``collect``, ``check_experts``) and
modelparallel/parallelize.py (``check``) for the model checks, config.py for the degrees,
expert/dispatch.py (``_agree``) for the one-rank failure.
"""

import copy
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OlmoeConfig, OlmoeForCausalLM

import harness
import modelparallel as smp
from modelparallel.config import build_config
from modelparallel.expert.config import MoEConfig
from moe_reference import VOCAB, reference_model, replica_batches


def test_degree_the_world_does_not_allow():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by expert_parallel_degree 2 x "
                                         r"tensor_parallel_degree 2 = 4"):
        build_config({"expert_parallel_degree": 2, "tensor_parallel_degree": 2}, 6)
    with pytest.raises(ValueError, match="expert_parallel_degree must be >= 1"):
        build_config({"expert_parallel_degree": 0}, 2)


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def _olmoe():
    return OlmoeForCausalLM(OlmoeConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB))


def model_errors():
    smp.init({"expert_parallel_degree": 2})
    return {
        "indivisible": _error_of(lambda: smp.DistributedModel(reference_model("mixtral", experts=3))),
        "indivisible_v2": _error_of(lambda: smp.transform(reference_model("qwen2_moe", experts=5))),
        "unknown_moe": _error_of(lambda: smp.transform(_olmoe())),
        "dense": _error_of(lambda: smp.DistributedModel(_llama())),
        "hf_moe": _error_of(lambda: smp.transform(reference_model("mixtral"), config=MoEConfig(smp_moe=False))),
    }


def test_bad_models_refused_by_name_on_every_rank():
    for errors in harness.run(2, model_errors):
        assert errors["indivisible"].startswith("ValueError: cannot apply expert parallelism"), errors
        assert "MixtralConfig.num_local_experts = 3 is not divisible by expert_parallel_degree 2" in errors["indivisible"]
        assert "Qwen2MoeConfig.num_experts = 5 is not divisible by expert_parallel_degree 2" in errors["indivisible_v2"]
        for key, cls, model_type in (("unknown_moe", "OlmoeForCausalLM", "olmoe"),
                                     ("dense", "LlamaForCausalLM", "llama")):
            assert (f"expert_parallel_degree 2, but {cls} (model_type '{model_type}') has no built-in expert layout; "
                    "the MoE architectures built in are mixtral, qwen2_moe") in errors[key], errors[key]
        assert "MoEConfig(smp_moe=False) keeps Hugging Face's own MoE layers" in errors["hf_moe"], errors["hf_moe"]


def test_v1_shard_degree_splitting_expert_groups_is_refused():
    from modelparallel.training.fsdp import check_degree

    with pytest.raises(NotImplementedError, match="sharded data parallel degree=2 with expert_parallel_degree=4"):
        check_degree(2, 4, 4)
    check_degree(4, 8, 2)  # shard groups of whole expert-parallel groups
    check_degree(8, 8, 4)  # every replica


def test_expert_with_context_parallelism_is_accepted_by_the_config():
    cfg = build_config({"expert_parallel_degree": 2, "context_parallel_degree": 2}, 4)
    assert (cfg.dp_degree, cfg.expert_parallel_degree, cfg.context_parallel_degree) == (2, 2, 2)


def fail_routing_on_rank1(all_to_all):
    """Rank 1's router hands the experts an index outside [0, num_experts): rank 1 raises its
    reason, rank 0 raises naming rank 1, at once."""
    smp.init({"expert_parallel_degree": 2})
    model = smp.transform(reference_model("mixtral"), config=MoEConfig(moe_all_to_all_dispatcher=all_to_all,
                                                                      moe_load_balancing="none"))
    if smp.rank() == 1:
        gate = model.model.layers[1].mlp.gate
        gate.register_forward_hook(lambda m, a, out: (out[0], out[1], out[2] + 4))
    ids = replica_batches(1, 2)[0][smp.rank()]
    start = time.monotonic()
    message = _error_of(lambda: model(ids, labels=ids))
    return message, time.monotonic() - start


@pytest.mark.parametrize("all_to_all", [True, False])
def test_routing_failure_on_one_rank_ends_every_rank(all_to_all):
    (msg0, t0), (msg1, t1) = harness.run(2, fail_routing_on_rank1, all_to_all)
    assert msg1.startswith("ValueError: top_k_index holds experts 4..7, outside [0, 4)"), msg1
    assert msg0 == "DispatchError: expert dispatch failed on rank(s) [1] (their error names the cause)", msg0
    assert max(t0, t1) < 30, (t0, t1)
