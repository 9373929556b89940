"""SageMaker v2 checkpoints at composed layouts: local (``SM_LOCAL_STATE_DICT``, one directory per
replication group from ``state.ranker``) at expert x hybrid (with and without context
parallelism) and tensor x context x data parallelism under hybrid sharding, and a sharded FSDP1
checkpoint at context x tensor parallelism. Each is saved, loaded into a freshly built model,
and must hold the saved tensors exactly and continue training bitwise like the uninterrupted run.
The 8-rank layout (tp 2 x cp 2 x dp 2, hybrid 2 of the 4 data x context ranks: FSDP1 over a
(replicate, shard) mesh per tp rank) also trains like one HF process on the whole batch.

A failure of the local round trips means the replication groups (training/replication.py,
meshes.holders) put ranks holding different shards in one directory, or left some out; of the
8-rank training, the hybrid mesh of sagemaker/v2/fsdp1.py under TP.
"""

import copy
import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

import harness
import modelparallel as tsm
from modelparallel import runtime, state
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type
from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer
from modelparallel.tp.layout import local_part
from reference import training_rtol
from v2_script import load_local, load_sharded, replication_group, save_local, save_sharded

VOCAB, ROWS, SEQ = 96, 4, 16


def _llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32, use_cache=False))


def _mixtral():
    config = MixtralConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                           max_position_embeddings=32, use_cache=False)
    return MixtralForCausalLM(config)


ARCHS = {"llama": (_llama, TransformerLayer), "mixtral": (_mixtral, MixtralDecoderLayer)}


def build(arch: str, seed: int, ref: list | None = None):
    """The v2 script's model (``transform``, FSDP1 without a mesh, auto-wrapped per layer) and
    AdamW; ``ref`` receives an untouched copy of the same weights."""
    make, layer = ARCHS[arch]
    torch.manual_seed(seed)
    hf = make()
    if ref is not None:
        ref.append(copy.deepcopy(hf))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    model = FSDP(tsm.transform(hf), auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(90 + step))


def train_step(model, optimizer, step: int, ref=None, opt_ref=None) -> float:
    """This rank's rows (split over the context ranks); returns the mean loss over the data x
    context ranks, checked against ``ref`` (one process on the whole batch) when given."""
    ids = _batch(step)
    rows = ROWS // state.dp_size
    mine = tsm.get_batch_for_cp_rank(ids[state.dp_rank * rows:(state.dp_rank + 1) * rows])
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=runtime.current().group(runtime.DP_CP_GROUP))
    mean = mean.item() / (state.dp_size * state.cp_size)
    if ref is not None:
        want = ref(ids, labels=ids).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        rel = abs(mean - want.item()) / abs(want.item())
        assert rel < training_rtol(step), f"step {step}: loss {mean} vs one process {want.item()} (rel {rel:.1e})"
    return mean


def held(model, optimizer) -> list[torch.Tensor]:
    """This rank's tensors: the local state dict's, and the optimizer state."""
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        tensors = [local_part(t).detach().clone() for t in model.state_dict().values()]
    for per_param in optimizer.state_dict()["state"].values():
        tensors += [local_part(t).detach().clone() for t in per_param.values() if torch.is_tensor(t)]
    return tensors


def local_round_trip(config: dict, arch: str, groups_expected, root: str, one_process: bool = False):
    tsm.init(config)
    ref = []
    model, optimizer = build(arch, 0, ref if one_process else None)
    if config.get("hybrid_shard_degree", 0) > 1:  # hybrid sharding really reached FSDP1
        assert model.sharding_strategy == ShardingStrategy.HYBRID_SHARD, model.sharding_strategy
        assert dist.get_world_size(model.process_group) == config["hybrid_shard_degree"]
    assert state.ranker.get_rep_groups() == groups_expected
    opt_ref = torch.optim.AdamW(ref[0].parameters(), lr=1e-2) if ref else None
    for step in range(2):
        train_step(model, optimizer, step, ref[0] if ref else None, opt_ref)
    save_local(model, optimizer, root, {"total_steps": 2}, replication_group())
    saved = held(model, optimizer)
    after = [train_step(model, optimizer, s) for s in (2, 3)]
    fresh, fresh_opt = build(arch, 1)
    before = held(fresh, fresh_opt)
    loaded = load_local(fresh, fresh_opt, root, {"total_steps": 0}, replication_group())
    assert loaded["total_steps"] == 2
    got = held(fresh, fresh_opt)
    assert len(got) == len(saved) and all(torch.equal(a, b) for a, b in zip(got, saved)), "loaded tensors differ"
    assert not all(torch.equal(a, b) for a, b in zip(before[:len(saved)], saved)), "the load changed nothing"
    resumed = [train_step(fresh, fresh_opt, s) for s in (2, 3)]
    assert resumed == after, f"resumed {resumed} vs uninterrupted {after}"
    return dist.get_rank()


@pytest.mark.parametrize("config, arch, groups", [
    # dp 4, ep 2, hybrid 2: dense halves {0,1} {2,3}; experts replicated over their own pair
    ({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, "mixtral", [[0, 2], [1, 3]]),
    # dp 2 (one ep group) x cp 2 (rank = 2 dp + cp), hybrid 2: dense halves over the cp pairs
    # {0,1} {2,3}, so 0 and 2 hold the same half but other experts; no two ranks hold the same
    ({"expert_parallel_degree": 2, "context_parallel_degree": 2, "hybrid_shard_degree": 2}, "mixtral",
     [[0], [1], [2], [3]]),
], ids=["ep2_hybrid2", "ep2_cp2_hybrid2"])
def test_local_checkpoint_round_trip(config, arch, groups, tmp_path):
    harness.run(4, local_round_trip, config, arch, groups, str(tmp_path))


def test_local_checkpoint_tp_cp_dp_hybrid_trains_like_one_process(tmp_path):
    """tp 2 x cp 2 x dp 2 (cluster: rank = 4 dp + 2 cp + tp), hybrid 2: each tp rank's four data x
    context ranks shard in cp pairs, replicated over dp."""
    config = {"tensor_parallel_degree": 2, "context_parallel_degree": 2, "hybrid_shard_degree": 2}
    harness.run(8, local_round_trip, config, "llama", [[0, 4], [1, 5], [2, 6], [3, 7]], str(tmp_path), True)


def _whole_directories(root: str, ep: int) -> None:
    """Each ``tp0_ep{j}`` directory, read with PyTorch's own reader: its ``.metadata`` covers every
    dense tensor whole and holds expert rank j's experts (E / ep of them) whole."""
    from torch.distributed.checkpoint import FileSystemReader

    for j in range(ep):
        saved = FileSystemReader(os.path.join(root, f"tp0_ep{j}")).read_metadata().state_dict_metadata
        for key, md in saved.items():
            if not hasattr(md, "chunks"):
                continue
            volume = sum(torch.Size(c.sizes).numel() for c in md.chunks)
            assert volume == md.size.numel(), f"tp0_ep{j}: {key} holds {volume} of {md.size.numel()} elements"
        experts = saved["model.model.layers.0.mlp.experts.gate_up_proj"].size
        assert experts[0] == 4 // ep, f"tp0_ep{j}: experts {tuple(experts)}"


def sharded_round_trip(config: dict, arch: str, root: str, queued: bool = False):
    """Saved (with an ``AsyncCallsQueue`` when ``queued``), loaded into a fresh model: the same
    tensors, the same losses after."""
    tsm.init(config)
    model, optimizer = build(arch, 0)
    for step in range(2):
        train_step(model, optimizer, step)
    queue = AsyncCallsQueue() if queued else None
    save_sharded(model, optimizer, root, {"total_steps": 2}, queue)
    saved = held(model, optimizer)
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking=True, process_group=model.process_group)
    after = [train_step(model, optimizer, s) for s in (2, 3)]
    ep = config.get("expert_parallel_degree", 1)
    if ep > 1 and dist.get_rank() == 0:
        _whole_directories(root, ep)
    fresh, fresh_opt = build(arch, 1)
    loaded = load_sharded(fresh, fresh_opt, root, {"total_steps": 0})
    assert loaded["total_steps"] == 2
    got = held(fresh, fresh_opt)
    assert len(got) == len(saved) and all(torch.equal(a, b) for a, b in zip(got, saved)), "loaded tensors differ"
    resumed = [train_step(fresh, fresh_opt, s) for s in (2, 3)]
    assert resumed == after, f"resumed {resumed} vs uninterrupted {after}"
    return dist.get_rank()


def test_sharded_fsdp1_checkpoint_at_cp2_tp2(tmp_path):
    """cp 2 x tp 2: FSDP1 shards over each tp rank's cp pair; one directory per tp rank."""
    harness.run(4, sharded_round_trip, {"tensor_parallel_degree": 2, "context_parallel_degree": 2}, "llama",
                os.path.join(str(tmp_path), "sharded"))


@pytest.mark.parametrize("config, world, queued", [
    ({"expert_parallel_degree": 2}, 2, False),
    ({"expert_parallel_degree": 2}, 4, True),
    ({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, 4, False),
], ids=["ep2", "ep2_dp2-async", "ep2_hybrid2"])
def test_sharded_fsdp1_checkpoint_under_expert_parallelism(config, world, queued, tmp_path):
    """The scripts' sharded save at expert parallelism: one directory per (tp, ep) rank, saved over
    the FSDP group, which spans every expert rank. Each directory must be whole (every dense
    tensor, its expert rank's experts) and resume exactly. A failure points at
    distributed/checkpoint/directories.py."""
    harness.run(world, sharded_round_trip, config, "mixtral", os.path.join(str(tmp_path), "sharded"), queued)
