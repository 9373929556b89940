"""The call shapes of SageMaker v2's shared training scripts, with a tiny Llama and synthetic data:
``transform``, FSDP1 auto-wrapped on ``TransformerLayer`` (``use_orig_params``), AdamW, and the
checkpoint calls of SageMaker's checkpointing page (sharded and local, async and not), each
written as the scripts and the page write it. Imported by the tests of this package."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM

import modelparallel as tsm
from modelparallel import state
from modelparallel.distributed.checkpoint.filesystem import DistributedFileSystemReader
from modelparallel.distributed.checkpoint.state_dict_loader import load
from modelparallel.distributed.checkpoint.state_dict_saver import async_save, save
from modelparallel.distributed.checkpoint.state_dict_utils import SMStateDictType, init_optim_state, sm_state_dict_type
from modelparallel.sagemaker.grad_norm import clip_grad_norm_
from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer
from modelparallel.sagemaker.utils.process_group_utils import get_global_ranks

VOCAB = 100


def build(seed: int = 0):
    """The scripts' model and optimizer (after ``tsm.init``)."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False)
    model = tsm.transform(LlamaForCausalLM(config))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model, optimizer, step: int) -> float:
    """One step of the scripts' loop: this replica's rows, clip by the global norm, AdamW; returns
    the loss averaged over the world as the scripts log it."""
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(100 + step % 2))  # two batches, learnable
    rows = 4 // state.dp_size
    mine = ids[state.dp_rank * rows:(state.dp_rank + 1) * rows]
    if state.cp_size > 1:  # the scripts' context-parallel split of the rows' sequences
        mine = tsm.get_batch_for_cp_rank(mine)
    loss = model(input_ids=mine, attention_mask=None, labels=mine)["loss"]
    loss.backward()
    clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return logged.item() / dist.get_world_size()


def replication_group():
    """The page's loop: every rank creates every replication group, keeps its own."""
    mine, ranks = None, None
    for replication_ranks in state.ranker.get_rep_groups():
        group = dist.new_group(replication_ranks)
        if dist.get_rank() in replication_ranks:
            mine, ranks = group, replication_ranks
    return mine, min(ranks)


def local_dir(root: str, model) -> str:
    return os.path.join(root, f"tp{state.tp_rank}_ep{state.ep_rank}_fsdp{model.rank}")


def sharded_dir(root: str) -> str:
    return os.path.join(root, f"tp{state.tp_rank}_ep{state.ep_rank}")


def save_sharded(model, optimizer, root: str, extra: dict, queue=None) -> None:
    """Async (with ``queue``) or sync sharded save, by the action ranks, over the FSDP group."""
    action_rank = state.ranker.get_rep_rank(dist.get_rank()) == 0
    process_group = model.process_group
    coordinator_rank = min(get_global_ranks(process_group))
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking=True, process_group=process_group)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer), **extra}
    if action_rank:
        kwargs = dict(checkpoint_id=sharded_dir(root), process_group=process_group, coordinator_rank=coordinator_rank)
        async_save(state_dict, queue=queue, **kwargs) if queue is not None else save(state_dict, **kwargs)


def load_sharded(model, optimizer, root: str, extra: dict) -> dict:
    process_group = model.process_group
    coordinator_rank = min(get_global_ranks(process_group))
    init_optim_state(optimizer, skip_empty_param=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer), **extra}
        load(state_dict, storage_reader=DistributedFileSystemReader(sharded_dir(root)),
             process_group=process_group, coordinator_rank=coordinator_rank)
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state_dict["optimizer"]))
    return state_dict


def save_local(model, optimizer, root: str, extra: dict, groups, queue=None) -> None:
    group, coordinator_rank = groups
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking=True, process_group=group)
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}
    kwargs = dict(checkpoint_id=local_dir(root, model), process_group=group, coordinator_rank=coordinator_rank)
    async_save(state_dict, queue=queue, **kwargs) if queue is not None else save(state_dict, **kwargs)


def load_local(model, optimizer, root: str, extra: dict, groups) -> dict:
    group, coordinator_rank = groups
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {"model": model.state_dict(), **extra}
        init_optim_state(optimizer, skip_empty_param=True)
        state_dict["optimizer"] = optimizer.state_dict()
    load(state_dict=state_dict, process_group=group, coordinator_rank=coordinator_rank,
         storage_reader=DistributedFileSystemReader(local_dir(root, model)))
    return state_dict


def save_sharded_dcp(model, optimizer, root: str, extra: dict) -> None:
    """The shared scripts' ``_save_sharded``: PyTorch's own DCP call over the FSDP group."""
    from torch.distributed import checkpoint

    process_group = model.process_group
    coordinator_rank = min(get_global_ranks(process_group))
    action_rank = state.ranker.get_rep_rank(dist.get_rank()) == 0
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer), **extra}
    if action_rank:
        checkpoint.save_state_dict(state_dict=state_dict, storage_writer=checkpoint.FileSystemWriter(sharded_dir(root)),
                                   planner=checkpoint.DefaultSavePlanner(), process_group=process_group,
                                   coordinator_rank=coordinator_rank)


def load_sharded_dcp(model, optimizer, root: str, extra: dict) -> dict:
    """The scripts' ``_load_sharded`` with PyTorch's DCP; the optimizer state is loaded into
    ``init_optim_state``'s placeholders (torch 2.13's ``load_sharded_optimizer_state_dict`` takes
    no process group)."""
    from torch.distributed import checkpoint

    process_group = model.process_group
    coordinator_rank = min(get_global_ranks(process_group))
    init_optim_state(optimizer, skip_empty_param=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer), **extra}
        checkpoint.load_state_dict(state_dict=state_dict, storage_reader=checkpoint.FileSystemReader(sharded_dir(root)),
                                   process_group=process_group, coordinator_rank=coordinator_rank,
                                   planner=checkpoint.DefaultLoadPlanner())
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state_dict["optimizer"]))
    return state_dict


def load_sharded_dcp_script_form(model, optimizer, root: str, extra: dict) -> dict:
    """The scripts' ``_load_sharded`` as written: the model state through DCP over the FSDP group,
    then ``load_sharded_optimizer_state_dict(..., process_group=model.process_group)`` (the call
    form of SageMaker's torch build, given by ``modelparallel run``: ``sagemaker.torch_calls``)
    and ``FSDP.optim_state_dict_to_load``."""
    from torch.distributed import checkpoint
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp.api import ShardedOptimStateDictConfig

    process_group = model.process_group
    coordinator_rank = min(get_global_ranks(process_group))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                              optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True)):
        state_dict = {"model": model.state_dict(), **extra}
        checkpoint.load_state_dict(state_dict=state_dict, storage_reader=checkpoint.FileSystemReader(sharded_dir(root)),
                                   process_group=process_group, coordinator_rank=coordinator_rank,
                                   planner=checkpoint.DefaultLoadPlanner())
        model.load_state_dict(state_dict["model"])
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state_dict["model"], optimizer_key="optimizer",
            storage_reader=checkpoint.FileSystemReader(sharded_dir(root)), process_group=model.process_group)
        flattened = FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=optim_state["optimizer"])
        optimizer.load_state_dict(flattened)
    return state_dict
