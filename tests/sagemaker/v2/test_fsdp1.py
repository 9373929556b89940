"""The user's own FSDP1 call after ``smp.init``, as SageMaker v2 scripts write it: checked
against the data-parallel mesh, and laid out by ``hybrid_shard_degree``.

A failure of the hybrid test means ``hybrid_shard_degree`` did not reach FSDP (parameters
sharded over all 4 ranks, or not at all) or the hybrid layout averages gradients wrong (losses
off the single process from step 2). A failure of the mesh tests means a wrong mesh reached
FSDP (which would then shard across tensor-parallel ranks or fail deep inside PyTorch) or that
the default, no mesh at all, is not the data-parallel one.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp
from test_v2_fsdp import llama_cfg, train_and_compare

POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})


def built(config):
    smp.init(config)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(llama_cfg())
    return ref, smp.transform(copy.deepcopy(ref))


def flat_shards(model):
    """(local flat shard, numel of the unit's original parameters) of every FSDP unit."""
    return [(m._flat_param.detach().clone(), sum(s.numel() for s in m._flat_param._shapes))
            for m in FSDP.fsdp_modules(model) if m._flat_param is not None]


def hybrid_two_of_four():
    ref, model = built({"tensor_parallel_degree": 1, "hybrid_shard_degree": 2})
    model = FSDP(model, auto_wrap_policy=POLICY, device_id=torch.device("cpu"), use_orig_params=True)
    assert model.sharding_strategy == ShardingStrategy.HYBRID_SHARD
    rank = dist.get_rank()
    for local, total in flat_shards(model):
        assert local.numel() == -(-total // 2), f"rank {rank}: {local.numel()} of {total}, not a half"
        pieces = [torch.empty_like(local) for _ in range(4)]
        dist.all_gather(pieces, local)
        # shard groups {0, 1} and {2, 3}: rank r's half is replicated on r ^ 2, the other half on r ^ 1
        assert torch.equal(pieces[rank], pieces[rank ^ 2]) and not torch.equal(pieces[rank], pieces[rank ^ 1])
    train_and_compare(ref, model)


def test_hybrid_shard_degree_2_of_4_shards_in_pairs_and_trains_like_one_process():
    harness.run(4, hybrid_two_of_four)


def replicate_when_one():
    _, model = built({"tensor_parallel_degree": 1, "hybrid_shard_degree": 1})
    model = FSDP(model, auto_wrap_policy=POLICY, device_id=torch.device("cpu"), use_orig_params=True)
    assert model.sharding_strategy == ShardingStrategy.NO_SHARD
    for local, total in flat_shards(model):
        assert local.numel() == total


def test_hybrid_shard_degree_1_replicates():
    harness.run(2, replicate_when_one)


def wrong_meshes_refused():
    _, model = built({"tensor_parallel_degree": 2})
    root = smp.tp_mesh()._get_root_mesh()
    wrong = [dict(device_mesh=smp.tp_mesh()), dict(device_mesh=root),
             dict(process_group=smp.get_tp_process_group())]
    for kwargs in wrong:
        with pytest.raises(ValueError, match=r"expected .*smp\.dp_mesh\(\)"):
            FSDP(model, device_id=torch.device("cpu"), use_orig_params=True, **kwargs)
    assert all(not isinstance(m, FSDP) for m in model.modules()), "a refused call left FSDP units behind"


def test_wrong_mesh_refused_naming_dp_mesh():
    harness.run(4, wrong_meshes_refused)


def no_mesh_means_dp(tp, world):
    ref, model = built({"tensor_parallel_degree": tp})
    model = FSDP(model, auto_wrap_policy=POLICY, device_id=torch.device("cpu"), use_orig_params=True)
    dp = smp.dp_mesh().mesh.tolist()
    assert dist.get_process_group_ranks(model.process_group) == dp
    train_and_compare(ref, model, steps=3)


def test_fsdp1_without_mesh_shards_over_dp_at_tp2():
    harness.run(4, no_mesh_means_dp, 2, 4)


def hybrid_strategy_at_default_degree(tp):
    ref, model = built({"tensor_parallel_degree": tp})
    model = FSDP(model, auto_wrap_policy=POLICY, device_id=torch.device("cpu"), use_orig_params=True,
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    assert model.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert dist.get_process_group_ranks(model.process_group) == smp.dp_mesh().mesh.tolist()
    for local, total in flat_shards(model):
        assert local.numel() == -(-total // smp.rdp_size())
    train_and_compare(ref, model, steps=3)


@pytest.mark.parametrize("tp,world", [(2, 4), (1, 2)])
def test_hybrid_strategy_at_degree_0_shards_over_all_dp_ranks(tp, world):
    """v2 scripts' default: sharding_strategy=HYBRID_SHARD, hybrid_shard_degree 0 (= DP). Failed
    at TP=2 ("Expected device_mesh to have ndim=2") and sharded over one rank at TP=1."""
    harness.run(world, hybrid_strategy_at_default_degree, tp)


def delayed_init_with_post_param_init_fn(tp):
    """The v2 scripts' delayed-init wrap: meta model, transform, DelayedParamIniter, FSDP with
    param_init_fn and post_param_init_fn (a TypeError before), TransformerLayer as the unit."""
    from modelparallel.delayed_param import DelayedParamIniter
    from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer

    smp.init({"tensor_parallel_degree": tp})
    config = llama_cfg()
    config.tie_word_embeddings = True
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = smp.transform(model)
    initer = DelayedParamIniter(model)
    post, calls = initer.get_post_param_init_fn(), []

    def counting_post(module):
        calls.append(type(module).__name__)
        post(module)

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    with initer.validate_params_and_buffers_inited():
        model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True,
                     param_init_fn=initer.get_param_init_fn(), post_param_init_fn=counting_post)
    assert calls == ["LlamaDecoderLayer", "LlamaDecoderLayer", "LlamaForCausalLM"], calls
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tie lost"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(1, 101, (2, 10), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(6):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("tp", [2, 1])
def test_post_param_init_fn_runs_per_unit_and_keeps_ties(tp):
    harness.run(2, delayed_init_with_post_param_init_fn, tp)


def local_checkpoint_round_trip(path):
    """The v2 scripts' local checkpoint under their default ``HYBRID_SHARD`` call: FSDP1's own
    ``LOCAL_STATE_DICT`` (refused by FSDP1 when it is handed a DeviceMesh), ``torch.save`` per
    rank, and a resume that continues exactly like the uninterrupted run."""
    from torch.distributed.fsdp import StateDictType

    from reference import token_batches

    def wrapped():
        ref, model = built({"tensor_parallel_degree": 1})
        model = FSDP(model, auto_wrap_policy=POLICY, device_id=torch.device("cpu"), use_orig_params=False,
                     sharding_strategy=ShardingStrategy.HYBRID_SHARD)  # the scripts' default use_orig_params
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = wrapped()
    batches = [b.chunk(smp.rdp_size())[smp.rdp_rank()] for b in token_batches(101, 4)]
    for ids in batches[:2]:
        step(model, opt, ids)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{path}/{dist.get_rank()}.pt")
    straight = [step(model, opt, ids) for ids in batches[2:]]
    fresh, fresh_opt = wrapped()
    state = torch.load(f"{path}/{dist.get_rank()}.pt", weights_only=False)
    with FSDP.state_dict_type(fresh, StateDictType.LOCAL_STATE_DICT):
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optimizer"])
    resumed = [step(fresh, fresh_opt, ids) for ids in batches[2:]]
    return straight, resumed


def test_local_checkpoint_under_the_default_hybrid_strategy(tmp_path):
    for straight, resumed in harness.run(2, local_checkpoint_round_trip, str(tmp_path)):
        assert straight == resumed
