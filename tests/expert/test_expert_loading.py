"""Ways into an expert-parallel model without any rank holding the whole model: shard-on-read
from an HF directory (meta build + ``load_hf_checkpoint``), ``transform(load_state_dict_from_rank0=True)``
(rank 0 real, the others on meta), and delayed initialization; each equals the eagerly built model
(logits, and the expert shards are the right rows of HF's stacked tensors).

A failure on the loaded model only -> modelparallel/materialize/loading.py reads the experts'
``Shard(0)`` block at the wrong offset; rank-0 sync only -> materialize/rank0_sync.py (the expert
mesh coordinates); delayed init only -> materialize/init_engine.py on the stacked experts.
"""

import copy

import pytest
import torch
from accelerate import init_empty_weights

import harness
import modelparallel as smp
from modelparallel.expert.config import MoEConfig
from moe_reference import ARCHS, reference_model, replica_batches
from reference import assert_close


def _ids():
    return replica_batches(1, 1, seed=11)[0][0]


def _check_expert_rows(model, ref):
    """This rank's expert rows of every stacked tensor are HF's rows for its experts."""
    ep, rank = smp.state.ep_size, smp.state.ep_rank
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")):
            n = p.shape[0] // ep
            assert torch.equal(p.to_local(), want[name][rank * n:(rank + 1) * n]), name


def shard_on_read(arch, path):
    smp.init({"expert_parallel_degree": 2})
    ref = reference_model(arch)
    if smp.rank() == 0:
        ref.save_pretrained(path)
    torch.distributed.barrier()
    with torch.device("meta"):
        model = ARCHS[arch][0](ref.config)
    model = smp.DistributedModel(model)
    smp.load_hf_checkpoint(model, path)
    _check_expert_rows(model.module, ref)
    assert_close(model(_ids()).logits, ref(_ids()).logits, "shard-on-read logits")


def from_rank0(arch):
    smp.init({"expert_parallel_degree": 2})
    ref = reference_model(arch)
    if smp.rank() == 0:
        model = copy.deepcopy(ref)
    else:
        with init_empty_weights():
            model = ARCHS[arch][0](ref.config)
    model = smp.transform(model, load_state_dict_from_rank0=True, config=MoEConfig(moe_load_balancing="aux_loss"))
    _check_expert_rows(model, ref)
    assert_close(model(_ids()).logits, ref(_ids()).logits, "rank-0 sync logits")


def delayed(arch):
    smp.init({"expert_parallel_degree": 2, "random_seed": 0})
    ref = reference_model(arch)
    with smp.delay_param_initialization():
        torch.manual_seed(0)
        model = ARCHS[arch][0](ref.config)
    model = smp.DistributedModel(model)
    _check_expert_rows(model.module, ref)
    assert_close(model(_ids()).logits, ref(_ids()).logits, "delayed-init logits")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_shard_on_read(arch, tmp_path):
    harness.run(2, shard_on_read, arch, str(tmp_path / arch))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_transform_from_rank0(arch):
    harness.run(2, from_rank0, arch)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_delayed_initialization(arch):
    harness.run(2, delayed, arch)
