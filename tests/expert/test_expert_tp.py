"""Expert tensor parallelism (``expert_tensor_parallel``: each expert's gate/up rows and down
columns split over the tensor-parallel ranks) equals one Hugging Face process on the same global
batch: logits, loss, every gradient, SGD and AdamW steps, at T=2 (2 ranks) and E=2 x T=2 (4
ranks), through v1's ``DistributedModel`` (alone and with FSDP2) and v2's ``transform`` with the
script's own FSDP2 or FSDP1 call; each rank holds 1/(E x T) of every experts tensor; the
collectives per MoE layer are the ones docs/parallelism.md states; a partial checkpoint saved at
T=2 resumes bit-exactly at T=1 and E=2, and a full one holds Hugging Face's whole experts.

Where to look: logits wrong -> the pairing all-to-all in expert/tensor_parallel.py (gate and up
features of another rank paired) or the partial-output sum in expert/style.py; only the router's
or the attention's gradients wrong -> the ``f`` on the experts' inputs (expert/style.py); expert
gradients off by a factor -> the 1/ep scale (expert/style.py) or the replica average (model_grads.py).
"""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import harness
import modelparallel as smp
from moe_reference import (distributed_copy, reference_model, replica_batches, train_like_one_process,
                           train_on_tensor_parallel_unions, train_transformed_like_one_process)
from state_helpers import gathered_state, train_steps


def _check_shards(module, ref, ep, tp):
    """Every experts tensor a ``[Shard(0), Shard(d)]`` DTensor over ("ep", "tp") whose local
    shard holds 1/(ep x tp) of HF's elements (under FSDP2, 1/(replicas x ep x tp))."""
    hf = dict(ref.named_parameters())
    found = 0
    for name, p in module.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            found += 1
            assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names[-2:] == ("ep", "tp"), name
            assert tuple(p.device_mesh.shape[-2:]) == (ep, tp), (name, p.device_mesh)
            want = (Shard(0), Shard(1 if name.endswith("gate_up_proj") else 2))
            assert p.placements[-2:] == want, p.placements
            # FSDP2 on top: its own dimension first, the expert replicas sharding dim 0 further
            assert p.to_local().numel() * p.device_mesh.size() == hf[name].numel(), (name, tuple(p.to_local().shape))
    assert found, "no experts tensor found"


def v1_training(arch, ep, tp, optimizer, **config):
    ref = reference_model(arch)
    model = distributed_copy(ref, expert_parallel_degree=ep, tensor_parallel_degree=tp, prescaled_batch=True,
                             expert_tensor_parallel=True, **config)
    _check_shards(model.module, ref, ep, tp)
    what = f"{arch} E={ep} T={tp} {optimizer}"
    kind = {"sgd": (0.1, torch.optim.SGD), "adamw": (1e-2, torch.optim.AdamW)}[optimizer]
    train_like_one_process(ref, model, replica_batches(3, smp.rdp_size()), what, *kind)


@pytest.mark.parametrize("arch,optimizer", [("mixtral", "sgd"), ("qwen2_moe", "adamw")])
def test_v1_tp2_trains_like_one_process(arch, optimizer):
    harness.run(2, v1_training, arch, 1, 2, optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_v1_tp2_ep2_trains_like_one_process(optimizer):
    harness.run(4, v1_training, "mixtral", 2, 2, optimizer)


def test_v1_tp2_with_fsdp2_trains_like_one_process():
    """v1's sharded data parallelism (4 ranks, T=2, D=2): the experts' FSDP2 group over their
    replicas, each shard split over "tp" too."""
    harness.run(4, v1_training, "mixtral", 1, 2, "adamw", sharded_data_parallel_degree=2)


def v2_fsdp2_training(ep, tp):
    """v2's way: ``transform``, then the script's own ``fully_shard`` calls: each experts module
    over the ranks holding the same expert shards, then each layer and the model over the
    data-parallel mesh (FSDP2 averages every gradient)."""
    from torch.distributed.fsdp import fully_shard

    smp.init({"expert_parallel_degree": ep, "tensor_parallel_degree": tp, "prescaled_batch": True,
              "expert_tensor_parallel": True})
    ref = reference_model("mixtral")
    model = smp.transform(copy.deepcopy(ref))
    _check_shards(model, ref, ep, tp)
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=smp.runtime.current().edp_mesh)
        fully_shard(layer, mesh=smp.dp_mesh())
    fully_shard(model, mesh=smp.dp_mesh())
    train_transformed_like_one_process(ref, model, replica_batches(3, smp.rdp_size()), f"v2 FSDP2 E={ep} T={tp}",
                                       grads=False)


def test_v2_transform_fsdp2_tp2_trains_like_one_process():
    harness.run(4, v2_fsdp2_training, 1, 2)


def v2_fsdp1_training():
    """v2's FSDP1 call without a mesh: the experts set apart from it and sharded over their
    replicas with FSDP2, each shard split over "tp" too."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True, "expert_tensor_parallel": True})
    ref = reference_model("mixtral")
    model = smp.transform(copy.deepcopy(ref))
    _check_shards(model, ref, 1, 2)
    model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    experts = model.module.model.layers[0].mlp.experts.gate_up_proj
    assert experts.to_local().numel() * 4 == ref.model.layers[0].mlp.experts.gate_up_proj.numel()
    train_transformed_like_one_process(ref, model, replica_batches(3, smp.rdp_size()), "v2 FSDP1 T=2", grads=False)


def test_v2_transform_fsdp1_tp2_trains_like_one_process():
    harness.run(4, v2_fsdp1_training)


def v2_all_gather_dispatcher():
    """``MoEConfig(moe_all_to_all_dispatcher=False)``: the all-gather dispatcher's partial outputs
    summed over "tp" alike (every gradient checked)."""
    from modelparallel.expert.config import MoEConfig

    smp.init({"tensor_parallel_degree": 2, "expert_parallel_degree": 2, "prescaled_batch": True,
              "expert_tensor_parallel": True})
    ref = reference_model("qwen2_moe")
    moe = MoEConfig(moe_all_to_all_dispatcher=False, moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.05,
                    moe_z_loss_coeff=0.0)
    model = smp.transform(copy.deepcopy(ref), config=moe)
    _check_shards(model, ref, 2, 2)
    train_transformed_like_one_process(ref, model, replica_batches(2, smp.rdp_size()), "v2 all-gather E=2 T=2")


def test_v2_all_gather_dispatcher_tp2_ep2():
    harness.run(4, v2_all_gather_dispatcher)


class _Collectives(TorchDispatchMode):
    """Counts the c10d collectives dispatched (in-place c10d and functional ones alike) by kind.
    (``CommDebugMode``'s module tracker trips over HF's experts module calling its activation.)"""

    def __init__(self):
        super().__init__()
        self.counts = {"all_to_all": 0, "all_reduce": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().replace("_", "")
        if name.startswith(("c10d::", "c10dfunctional::")):
            for kind in self.counts:
                self.counts[kind] += kind.replace("_", "") in name
        return func(*args, **(kwargs or {}))


def collectives(etp):
    """The collectives of one forward and backward of a 2-layer Mixtral at T=2."""
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True, "expert_tensor_parallel": etp})
    model = smp.transform(reference_model("mixtral"))
    ids = replica_batches(1, 1)[0][0]
    with _Collectives() as mode:
        model(ids, labels=ids).loss.backward()
    return mode.counts["all_to_all"], mode.counts["all_reduce"]


def test_collectives_per_moe_layer():
    """What docs/parallelism.md states: per MoE layer, expert TP adds one pairing all-to-all and
    one all-reduce of the output forward, the reverse all-to-all and the all-reduces of the input's
    and router weights' gradients backward (and no exchange over a one-rank "ep")."""
    whole = harness.run(2, collectives, False)[0]
    split = harness.run(2, collectives, True)[0]
    layers = 2
    assert (split[0] - whole[0], split[1] - whole[1]) == (2 * layers, 3 * layers), (whole, split)


def build(seed, ep=1, tp=1, etp=False):
    smp.init({"expert_parallel_degree": ep, "tensor_parallel_degree": tp, "random_seed": seed,
              "prescaled_batch": True, "expert_tensor_parallel": etp})
    model = smp.DistributedModel(reference_model("mixtral", seed=seed))
    return model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


def train(model, optimizer, steps):
    data = replica_batches(steps, 2)  # the same global batch at every layout
    return train_steps(model, optimizer, [torch.cat(data[s])[smp.rdp_rank()::smp.rdp_size()] for s in range(steps)])


def save_at_expert_tp(path):
    model, optimizer = build(0, tp=2, etp=True)
    train(model, optimizer, 2)
    smp.save_checkpoint(path, "step_2", user_content={"step": 2})
    smp.save_checkpoint(path, "export", partial=False)
    return gathered_state(model, optimizer)


def resume_at(path, expected, ep, tp, etp):
    model, optimizer = build(7, ep, tp, etp)
    before = gathered_state(model, optimizer)
    assert any(not torch.equal(before[k], v) for k, v in expected.items() if k.startswith("model/")), \
        "a fresh model already equal: the load would prove nothing"
    assert smp.resume_from_checkpoint(path, tag="step_2") == {"step": 2}
    got = gathered_state(model, optimizer)
    assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))
    for key, want in expected.items():
        assert torch.equal(got[key], want), f"{key}: not bit-equal after resuming at E={ep} T={tp} ETP={etp}"


def test_saved_at_expert_tp2_resumes_at_tp1_and_ep2(tmp_path):
    from transformers import MixtralForCausalLM

    expected = harness.run(2, save_at_expert_tp, str(tmp_path))[0]
    assert expected["model/model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 96, 32)
    for ep, tp, etp in ((1, 1, False), (2, 1, False)):
        harness.run(2, resume_at, str(tmp_path), expected, ep, tp, etp)
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "export")  # whole experts under HF's keys
    for key, value in hf.state_dict().items():
        assert torch.equal(value, expected[f"model/{key}"]), key


def test_refusals_name_the_key_and_the_numbers():
    """Checked in one process, before any collective: an intermediate size the degree does not
    divide, sequence parallelism, a model without a built-in expert layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from modelparallel.expert import check_experts
    from modelparallel.models.mixtral import EXPERTS

    model = reference_model("mixtral")  # intermediate size 48
    with pytest.raises(ValueError, match=r"intermediate size 48 .* divisible by tensor_parallel_degree 5"):
        check_experts(model, 1, EXPERTS, None, tp=5)
    with pytest.raises(NotImplementedError, match="expert_tensor_parallel with sequence_parallel"):
        check_experts(model, 1, EXPERTS, None, tp=2, sequence_parallel=True)
    assert check_experts(model, 1, EXPERTS, None, tp=2).tp == 2
    dense = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, vocab_size=96))
    with pytest.raises(ValueError, match="expert_tensor_parallel at degree 2, but LlamaForCausalLM"):
        check_experts(dense, 1, None, None, ("mixtral",), tp=2)


@pytest.mark.parametrize("key", ["pipeline_parallel_degree", "context_parallel_degree"])
def test_refused_with_pipeline_and_context_parallelism(key):
    from modelparallel.config import build_config

    with pytest.raises(NotImplementedError, match=f"expert_tensor_parallel with {key} 2"):
        build_config({"tensor_parallel_degree": 2, "expert_tensor_parallel": True, key: 2}, 4)
    build_config({"expert_tensor_parallel": True, key: 2}, 4)  # at TP 1 the key changes nothing


def shard_on_read(path):
    """A meta build loaded with ``load_hf_checkpoint``: each rank reads its own block of every
    experts tensor (gate/up rows, down columns) and the logits are HF's."""
    from reference import assert_close
    from transformers import MixtralForCausalLM

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True, "expert_tensor_parallel": True})
    ref = reference_model("mixtral")
    if smp.rank() == 0:
        ref.save_pretrained(path)
    torch.distributed.barrier()
    with torch.device("meta"):
        model = MixtralForCausalLM(ref.config)
    model = smp.DistributedModel(model)
    smp.load_hf_checkpoint(model, path)
    t, hf = smp.tp_rank(), dict(ref.named_parameters())
    for name, p in model.module.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")):
            dim = 1 if name.endswith("gate_up_proj") else 2
            assert torch.equal(p.to_local(), hf[name].chunk(2, dim)[t]), name
    ids = replica_batches(1, 1, seed=11)[0][0]
    assert_close(model(ids).logits, ref(ids).logits, "shard-on-read logits")


def test_shard_on_read_reads_each_ranks_block(tmp_path):
    harness.run(2, shard_on_read, str(tmp_path / "hf"))


def union_batch():
    """SageMaker's default ``prescaled_batch`` false: each TP rank brings its own batch and the
    group computes on their union, which every rank of the group then holds at the MoE layers."""
    ref = reference_model("mixtral")
    model = distributed_copy(ref, tensor_parallel_degree=2, expert_tensor_parallel=True)
    train_on_tensor_parallel_unions(ref, model, 2, 2)


def test_union_batch_of_the_tensor_parallel_group():
    harness.run(2, union_batch)
