"""SageMaker v2's local checkpoint (``SM_LOCAL_STATE_DICT``, async) over an FSDP2 (``fully_shard``)
model from ``transform``: saved per rank with its replication group, loaded into a fresh model
and optimizer, training continues bitwise like the uninterrupted run.

A failure means the local state dict of FSDP2's DTensor shards (or their optimizer state) is not
saved or restored exactly, or the load does not land in the model's own memory.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as tsm
from modelparallel import state
from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.distributed.checkpoint.filesystem import DistributedFileSystemReader
from modelparallel.distributed.checkpoint.state_dict_loader import load
from modelparallel.distributed.checkpoint.state_dict_saver import async_save
from modelparallel.distributed.checkpoint.state_dict_utils import SMStateDictType, init_optim_state, sm_state_dict_type
from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer
from v2_script import replication_group

VOCAB = 100


def build(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False)
    model = tsm.transform(LlamaForCausalLM(config))
    for m in model.modules():
        if isinstance(m, TransformerLayer):
            fully_shard(m, mesh=tsm.dp_mesh())
    fully_shard(model, mesh=tsm.dp_mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model, optimizer, i):
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(100 + i % 2))
    rows = 4 // state.dp_size
    mine = ids[state.dp_rank * rows:(state.dp_rank + 1) * rows]
    loss = model(input_ids=mine, labels=mine)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = loss.detach().clone()
    dist.all_reduce(out)
    return out.item()


def fsdp2_local_round_trip(root):
    tsm.init({"tensor_parallel_degree": 1})
    model, optimizer = build(0)
    first = [step(model, optimizer, i) for i in range(3)]
    group, coordinator = replication_group()
    where = os.path.join(root, f"tp{state.tp_rank}_fsdp{state.dp_rank}")
    queue = AsyncCallsQueue()
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        sd = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}
    async_save(sd, checkpoint_id=where, process_group=group, coordinator_rank=coordinator, queue=queue)
    after = [step(model, optimizer, i) for i in range(3, 6)]  # while / after the background write
    queue.maybe_finalize_async_calls(blocking=True, process_group=group)
    assert after[-1] < first[0], (first, after)

    fresh, fresh_opt = build(1)
    with sm_state_dict_type(fresh, SMStateDictType.SM_LOCAL_STATE_DICT):
        sd = {"model": fresh.state_dict(), "step": 0}
        init_optim_state(fresh_opt, skip_empty_param=True)
        sd["optimizer"] = fresh_opt.state_dict()
    load(state_dict=sd, process_group=group, coordinator_rank=coordinator,
         storage_reader=DistributedFileSystemReader(where))
    assert sd["step"] == 3
    resumed = [step(fresh, fresh_opt, i) for i in range(3, 6)]
    assert resumed == after, (resumed, after)
    return dist.get_rank()


def test_fsdp2_local_async_resumes_exactly(tmp_path):
    harness.run(2, fsdp2_local_round_trip, str(tmp_path))
