"""SageMaker v2's way: ``transform(model, config=MoEConfig(...))`` then the script's own FSDP1
call without a mesh, and ``MoEConfig``'s routing options, against one Hugging Face process.

Where to look: FSDP1 errors or drifting losses -> modelparallel/expert/fsdp1.py (experts set apart
from the user's FSDP1 call and sharded over their replicas); all-gather dispatcher wrong ->
expert/dispatch.py ``dispatch_all_gather``; Sinkhorn or z-loss wrong -> expert/routing.py
against the independent reference below; aux loss present with "none" -> routing.apply_routing.
"""

import copy
import functools

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

import harness
import modelparallel as smp
from modelparallel.expert.config import MoEConfig
from moe_reference import reference_loss, reference_model, replica_batches, train_transformed_like_one_process

LAYERS = {"mixtral": MixtralDecoderLayer, "qwen2_moe": Qwen2MoeDecoderLayer}
AUX = dict(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.0)


def transformed(arch, ep, moe, tp=1, hybrid_shard_degree=0, **config_kw):
    smp.init({"expert_parallel_degree": ep, "tensor_parallel_degree": tp, "prescaled_batch": True,
              "hybrid_shard_degree": hybrid_shard_degree})
    ref = reference_model(arch, **config_kw)
    return ref, smp.transform(copy.deepcopy(ref), config=moe)


def fsdp1_without_mesh(arch, ep, use_orig_params, hybrid_shard_degree=0):
    ref, model = transformed(arch, ep, MoEConfig(**AUX), hybrid_shard_degree=hybrid_shard_degree)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LAYERS[arch]})
    model = FSDP(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    experts = model.module.model.layers[0].mlp.experts.gate_up_proj
    replicated = hybrid_shard_degree in (1, 2)  # 4 data-parallel ranks, E=2: shard groups of one replica
    assert experts.to_local().shape[0] == (2 if replicated else 1), (experts.placements, experts.to_local().shape)
    train_transformed_like_one_process(ref, model, replica_batches(3, smp.rdp_size()), f"{arch} FSDP1", grads=False)


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_v2_fsdp1_call_without_mesh_trains_like_one_process(arch, use_orig_params):
    harness.run(4, fsdp1_without_mesh, arch, 2, use_orig_params)


def fsdp2_over_the_meshes(arch):
    """v2's FSDP2 way at E=2 on 4 ranks: each experts module ``fully_shard``ed over the 2 ranks
    holding the same experts (``expert_dp_mesh``), then each layer and the model over all 4."""
    from torch.distributed.fsdp import fully_shard

    from modelparallel.expert import is_expert_parallel

    ref, model = transformed(arch, 2, MoEConfig(**AUX))
    for experts in [m for m in model.modules() if is_expert_parallel(m)]:
        fully_shard(experts, mesh=smp.expert_dp_mesh())
    for layer in model.model.layers:
        fully_shard(layer, mesh=smp.dp_mesh())
    fully_shard(model, mesh=smp.dp_mesh())
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    hf = ref.model.layers[0].mlp.experts.gate_up_proj
    assert experts.to_local().numel() * 4 == hf.numel(), (experts.placements, tuple(experts.to_local().shape))
    train_transformed_like_one_process(ref, model, replica_batches(3, smp.rdp_size()), f"{arch} FSDP2", grads=False)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_v2_fsdp2_trains_like_one_process(arch):
    harness.run(4, fsdp2_over_the_meshes, arch)


@pytest.mark.parametrize("hybrid_shard_degree", [1, 2])
def test_v2_fsdp1_hybrid_shard_degree(hybrid_shard_degree):
    """hybrid_shard_degree 1 (replicate) and 2 (shard in pairs, dense and experts' groups alike)."""
    harness.run(4, fsdp1_without_mesh, "mixtral", 2, True, hybrid_shard_degree)


def hybrid_cutting_groups():
    smp.init({"expert_parallel_degree": 4, "hybrid_shard_degree": 2})
    model = smp.transform(reference_model("mixtral"), config=MoEConfig(**AUX))
    with pytest.raises(NotImplementedError, match="hybrid_shard_degree=2 with expert_parallel_degree=4"):
        FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))


def test_hybrid_shard_degree_cutting_expert_groups_is_refused():
    harness.run(4, hybrid_cutting_groups)


def dispatcher(arch, all_to_all, tp):
    ref, model = transformed(arch, 2, MoEConfig(moe_all_to_all_dispatcher=all_to_all, **AUX), tp=tp)
    train_transformed_like_one_process(ref, model, replica_batches(3, smp.rdp_size()), f"{arch} a2a={all_to_all}")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_all_gather_dispatcher(arch):
    harness.run(2, dispatcher, arch, False, 1)


def test_all_gather_dispatcher_with_tensor_parallelism():
    harness.run(4, dispatcher, "mixtral", False, 2)


# ---- an independent single-process statement of Sinkhorn routing and the z-loss -------------

def _balanced(logits: torch.Tensor) -> torch.Tensor:
    """Alternate row and column normalization of exp(logits) to uniform marginals (row sums 1/T,
    column sums 1/E), from a column scaling of ones, until the column scaling moves < 1e-4."""
    k = logits.exp()
    t, e = k.shape
    c = torch.ones(e)
    while True:
        r = 1 / (t * ((k * c).sum(1) + 1e-8))
        c_next = 1 / (e * ((k * r[:, None]).sum(0) + 1e-8))
        done = (c_next - c).abs().mean() <= 1e-4
        c = c_next
        if done:
            return k * r[:, None] * c


def _route(module, args, output):
    """Forward hook of a reference router: record its z-loss term; in training with Sinkhorn,
    choose on balanced scores and weight by the softmax at the choice."""
    logits, weights, index = output
    module._z_terms.append(torch.logsumexp(logits.float(), -1).square().mean())
    if not (module._sinkhorn and module.training):
        return output
    choice = torch.topk(_balanced(logits.detach().float()), index.shape[-1], dim=-1).indices
    return logits, torch.softmax(logits.float(), -1).gather(1, choice).to(weights.dtype), choice


def _routers(ref):
    return [m for m in ref.modules() if type(m).__name__.endswith("TopKRouter")]


def _with_routing(ref, sinkhorn: bool, z_coeff: float):
    for gate in _routers(ref):
        gate._z_terms, gate._sinkhorn = [], sinkhorn
        gate.register_forward_hook(_route)
    ref._z_coeff = z_coeff
    return ref


def reference_with_z(ref, batches):
    """The job's loss with the z-loss: per replica, HF's loss plus z_coeff x the layers' terms."""
    losses = []
    for ids in batches:
        loss = ref(ids, labels=ids).loss
        terms = [t for gate in _routers(ref) for t in gate._z_terms]
        for gate in _routers(ref):
            gate._z_terms.clear()
        losses.append(loss + ref._z_coeff * torch.stack(terms).sum())
    return torch.stack(losses).mean()


def routing_options(arch, balancing):
    moe = MoEConfig(moe_load_balancing=balancing, moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01)
    ref, model = transformed(arch, 2, moe)
    _with_routing(ref, balancing == "sinkhorn", 0.01)
    if balancing != "aux_loss":
        ref.router_aux_loss_coef = 0.0
    train_transformed_like_one_process(ref, model, replica_batches(3, smp.rdp_size()), f"{arch} {balancing}",
                                       reference=reference_with_z)
    ids = replica_batches(1, 1, seed=9)[0][0]
    model.eval(), ref.eval()
    with torch.no_grad():  # evaluation routes as HF's router does (no Sinkhorn)
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("balancing", ["sinkhorn", "none", "aux_loss"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_routing_options_like_one_process(arch, balancing):
    harness.run(2, routing_options, arch, balancing)
