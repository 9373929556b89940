"""The v2 scripts' full export (FSDP1's ``FULL_STATE_DICT`` with ``rank0_only`` and CPU offload,
``torch.save`` on rank 0 beside the config) at context and expert parallelism: every exported
tensor is the whole HF tensor, and ``from_pretrained`` of the export gives the next batch's loss of one HF process trained
on the same global batches (within the training's rounding).

A failure at expert parallelism only points at the experts FSDP1 leaves out of its state dict
(``expert/fsdp1.py``: they are sharded by FSDP2 over their replicas); at context parallelism at
the CP wrapping left in the state dict's names.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import AutoModelForCausalLM

import harness
import modelparallel as tsm
from reference import training_rtol
from test_v2_composed_checkpoints import _batch, build, train_step

STEPS = 2


def export(config: dict, arch: str, path: str):
    tsm.init(config)
    ref = []
    model, optimizer = build(arch, 0, ref)
    opt_ref = torch.optim.AdamW(ref[0].parameters(), lr=1e-2)
    for step in range(STEPS):
        train_step(model, optimizer, step, ref[0], opt_ref)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
        state_dict = model.state_dict()
        if dist.get_rank() == 0:
            torch.save(state_dict, f"{path}/pytorch_model.bin")
            ref[0].config.save_pretrained(path)
    dist.barrier()
    return {k: v.detach().clone() for k, v in ref[0].state_dict().items()} if dist.get_rank() == 0 else None


@pytest.mark.parametrize("config, arch, world", [
    ({"context_parallel_degree": 2}, "llama", 2),
    ({"expert_parallel_degree": 2}, "mixtral", 2),
    ({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, "mixtral", 4),
], ids=["cp2", "ep2", "ep2_hybrid2"])
def test_full_export_loads_as_the_trained_model(config, arch, world, tmp_path):
    want = harness.run(world, export, config, arch, str(tmp_path))[0]
    exported = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert sorted(exported) == sorted(want), sorted(set(exported) ^ set(want))
    for name, tensor in exported.items():
        assert type(tensor) is torch.Tensor and tensor.shape == want[name].shape, (name, type(tensor), tensor.shape)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ref = copy.deepcopy(loaded)
    ref.load_state_dict(want)
    ids = _batch(STEPS)
    got, expect = loaded(ids, labels=ids).loss.item(), ref(ids, labels=ids).loss.item()
    rel = abs(got - expect) / abs(expect)
    assert rel < training_rtol(STEPS), f"the export's loss {got} vs one process trained alike {expect} (rel {rel:.1e})"
