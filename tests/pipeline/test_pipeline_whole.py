"""``smp.transform`` at ``pipeline_parallel_degree`` > 1: a v2 script's own loop
(``loss = model(ids, labels=ids).loss; loss.backward(); optimizer.step()``) trains a model cut
into stages exactly like one Hugging Face process on the global batch.

Each case transforms a tiny Llama (no weights tied across stages), optionally wraps it in the
user's FSDP (v2's form, over ``smp.dp_mesh()``), and runs AdamW steps against the untouched model
on the whole batch: every step's loss (every rank gets the last stage's) and the first step's
gradients by name. A gradient mismatch on an early stage only means the gradient sent back
(``pipeline/whole.py``: ``_Received``, ``_Sent``) is wrong; on the last stage, the swapped input of
its first block; a loss right on the last stage only, the broadcast at the end of the forward.
"""

import copy
import os
import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import harness
import modelparallel as smp
from reference import (assert_replicas_train_like_one_process, context_replicas_train_like_one_process, token_batches,
                       tolerance, training_rtol)

VOCAB, LAYERS = 61, 4


def build(arch: str):
    if arch == "mixtral":
        return MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                                max_position_embeddings=32, num_local_experts=4,
                                                num_experts_per_tok=2, tie_word_embeddings=False))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32, tie_word_embeddings=False))


def wrap(model, how: str, use_orig_params: bool = False):
    if how.startswith("checkpointed"):  # PyTorch's activation checkpointing of every block, as v2 scripts
        block = type(next(iter(model.model.layers)))
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block))
        how = how.removeprefix("checkpointed").lstrip("-") or "plain"
    if how == "fsdp1":  # over the data-parallel ranks (v2 scripts give no mesh: the library lays it out)
        block = type(next(iter(model.model.layers)))
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})
        return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    if how == "fsdp2":
        for block in model.model.layers:
            fully_shard(block, mesh=smp.dp_mesh())
        return fully_shard(model, mesh=smp.dp_mesh())
    return model


def whole_batches_train(config: dict, arch: str, how: str):
    smp.init({"random_seed": 1, **config})
    torch.manual_seed(1)
    ref = build(arch)
    stage = smp.transform(copy.deepcopy(ref))
    names = sorted(n for n, _ in stage.named_parameters())
    model = wrap(stage, how)
    named = how in ("plain", "fsdp2")  # FSDP1's flat shards and checkpoint wrappers rename parameters
    check = None if named else functools.partial(assert_whole_norm, ref, model)
    assert_replicas_train_like_one_process(ref, model, token_batches(VOCAB, 4, rows=4, seq=8), lr=1e-2,
                                           after_backward=check, compare_grads=named)
    return names


def assert_whole_norm(ref, model, step):
    """Without HF's parameter names: the first step's gradient norm over the whole model
    (``smp.clip_grad_norm_``, checked against torch's on one process in
    ``test_clip_grad_norm_under_pipeline``) equals the reference's, within the norm of the
    per-element tolerances (triangle inequality: | |g| - |h| | <= |g - h|) plus the norm's own
    rounding (a sum of ~10^4 squares in fp32 in another order: 1e-5 relative)."""
    if step:
        return
    grads = [p.grad for p in ref.parameters()]
    expected = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
    bound = math.sqrt(sum(g.numel() * tolerance(g) ** 2 for g in grads)) + 1e-5 * expected
    norm = smp.clip_grad_norm_(model, float("inf")).item()
    assert abs(norm - expected) <= bound, (norm, expected, bound)


@pytest.mark.parametrize("world, config, arch, how", [
    pytest.param(2, {"pipeline_parallel_degree": 2}, "llama", "plain", marks=pytest.mark.smoke),
    (4, {"pipeline_parallel_degree": 4}, "llama", "plain"),
    (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, "llama", "plain"),
    (4, {"pipeline_parallel_degree": 2}, "llama", "fsdp1"),
    (4, {"pipeline_parallel_degree": 2}, "llama", "fsdp2"),
    (4, {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2}, "mixtral", "fsdp1"),
    (8, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, "llama", "fsdp1"),
    (2, {"pipeline_parallel_degree": 2}, "llama", "checkpointed"),
    (4, {"pipeline_parallel_degree": 2}, "llama", "checkpointed-fsdp2"),
])
def test_transform_under_pipeline_trains_like_one_process(world, config, arch, how):
    names = harness.run(world, whole_batches_train, config, arch, how)
    assert all(len(n) < len(list(build(arch).parameters())) for n in names), "a stage holds the whole model"


def context_ranks_train(how: str):
    """pipeline 2 x context 2: each context rank gets its part of the rows' sequences."""
    smp.init({"pipeline_parallel_degree": 2, "context_parallel_degree": 2, "random_seed": 1})
    torch.manual_seed(1)
    ref = build("llama")
    model = wrap(smp.transform(copy.deepcopy(ref)), how)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    context_replicas_train_like_one_process(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), model, optimizer,
                                            lambda loss: loss.backward(), token_batches(VOCAB, 4, rows=2, seq=8),
                                            grads_of=model if how == "fsdp2" else None)


@pytest.mark.parametrize("how", ["fsdp2"])
def test_transform_under_pipeline_and_context_parallelism(how):
    harness.run(4, context_ranks_train, how)


def evaluate():
    """Without gradients: the loss reaches every stage; without labels the last stage has the
    logits and the others a loss of None."""
    smp.init({"pipeline_parallel_degree": 2, "random_seed": 1})
    torch.manual_seed(1)
    ref = build("llama")
    model = smp.transform(copy.deepcopy(ref))
    ids = token_batches(VOCAB, 1, rows=2, seq=8)[0]
    with torch.no_grad():
        want, loss = ref(ids, labels=ids), model(ids, labels=ids).loss
        out = model(ids)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want.loss, rtol=training_rtol(0), atol=0)
    if smp.pp_rank() == 1:
        torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=tolerance(want.logits))
    else:
        assert out.loss is None and "logits" not in out


def test_evaluation_under_pipeline():
    harness.run(2, evaluate)


def clip_norm(config: dict, how: str):
    """v2's ``smp.clip_grad_norm_(model, max_norm)`` over a pipelined model: one process's norm."""
    smp.init({"random_seed": 1, **config})
    torch.manual_seed(1)
    ref = build("llama")
    model = wrap(smp.transform(copy.deepcopy(ref)), how)
    ids = token_batches(VOCAB, 1, rows=4, seq=8)[0]
    ref(ids, labels=ids).loss.backward()
    mine = ids.chunk(smp.rdp_size())[smp.rdp_rank()]
    model(mine, labels=mine).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    # a sum of ~10^4 squares in fp32 in another order: eps 1.2e-7 x sqrt(10^4) ~ 1e-5
    torch.testing.assert_close(smp.clip_grad_norm_(model, 1e9), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("world, config, how", [
    (2, {"pipeline_parallel_degree": 2}, "plain"),
    (4, {"pipeline_parallel_degree": 2}, "fsdp1"),
    (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, "fsdp2"),
])
def test_clip_grad_norm_under_pipeline(world, config, how):
    harness.run(world, clip_norm, config, how)


def fsdp1_stage(seed: int):
    torch.manual_seed(seed)
    model = wrap(smp.transform(build("llama")), "fsdp1", use_orig_params=True)  # as the v2 scripts
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_loss(model, optimizer, step: int) -> float:
    ids = token_batches(VOCAB, step + 1, rows=4, seq=8)[step]
    mine = ids.chunk(smp.rdp_size())[smp.rdp_rank()]
    loss = model(mine, labels=mine).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def sharded_state(model, optimizer) -> dict:
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer)}


def stages_checkpoint(root: str):
    """v2's sharded save at pipeline degree 2 (FSDP1 per stage): over the world it resumes exactly;
    over one stage's FSDP group (the scripts' call) it is refused before anything is written."""
    from modelparallel.distributed.checkpoint.state_dict_loader import load
    from modelparallel.distributed.checkpoint.state_dict_saver import save
    from modelparallel.distributed.checkpoint.state_dict_utils import init_optim_state
    from torch.distributed.fsdp import StateDictType

    smp.init({"pipeline_parallel_degree": 2, "random_seed": 1})
    model, optimizer = fsdp1_stage(0)
    for step in range(2):
        step_loss(model, optimizer, step)
    state = sharded_state(model, optimizer)
    with pytest.raises(ValueError, match=r"this process group holds stage\(s\) \[\d\] only"):
        save(state, checkpoint_id=f"{root}/refused", process_group=model.process_group,
             coordinator_rank=min(dist.get_process_group_ranks(model.process_group)))
    save(state, checkpoint_id=f"{root}/ckpt")
    after = [step_loss(model, optimizer, step) for step in range(2, 4)]
    fresh, fresh_opt = fsdp1_stage(1)
    init_optim_state(fresh_opt, skip_empty_param=True)  # the scripts' call: slots to load into
    state = sharded_state(fresh, fresh_opt)
    load(state, checkpoint_id=f"{root}/ckpt")
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, state["optimizer"]))
    resumed = [step_loss(fresh, fresh_opt, step) for step in range(2, 4)]
    assert resumed == after, (resumed, after)
    return sorted(os.listdir(root))


def test_v2_sharded_checkpoint_under_pipeline(tmp_path):
    listings = harness.run(4, stages_checkpoint, str(tmp_path))
    assert all(names == ["ckpt"] for names in listings), listings
