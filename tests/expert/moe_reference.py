"""Tiny Mixtral and Qwen2-MoE models and the single-process reference for expert-parallel tests.

Every data-parallel replica brings its own batch. Hugging Face's auxiliary load-balancing loss is
a function of one forward's tokens (not a mean over tokens), so the reference runs one HF forward
per replica batch and averages the replicas' losses: its gradient is what averaging the replicas'
gradients must give (the mean of the replicas' losses is the job's loss).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

import modelparallel as smp
from reference import assert_close, assert_grads_match, training_rtol

VOCAB = 96
SEQ = 8
EXPERTS = 4


def mixtral_config(experts: int = EXPERTS, top_k: int = 2, layers: int = 2) -> MixtralConfig:
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=top_k,
                           vocab_size=VOCAB, max_position_embeddings=32, output_router_logits=True,
                           router_aux_loss_coef=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _eager(config)


def _eager(config):
    """HF's eager attention and experts (its default grouped-GEMM experts kernel has no fp64,
    which the reference's fp64 twin needs to measure rounding noise)."""
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def qwen2_moe_config(experts: int = EXPERTS, top_k: int = 2, layers: int = 3) -> Qwen2MoeConfig:
    # the middle layer is a dense feed-forward: sparse and dense layers interleave
    config = Qwen2MoeConfig(hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                            shared_expert_intermediate_size=36, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=experts, num_experts_per_tok=top_k,
                            mlp_only_layers=[1], vocab_size=VOCAB, max_position_embeddings=32,
                            output_router_logits=True, router_aux_loss_coef=0.05, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2)
    return _eager(config)


ARCHS = {"mixtral": (MixtralForCausalLM, mixtral_config), "qwen2_moe": (Qwen2MoeForCausalLM, qwen2_moe_config)}


def reference_model(arch: str, seed: int = 0, **config_kw):
    cls, config = ARCHS[arch]
    torch.manual_seed(seed)
    return cls(config(**config_kw))


def replica_batches(steps: int, replicas: int, rows: int = 2, seed: int = 5) -> list[list[torch.Tensor]]:
    """``steps`` x ``replicas`` token batches (rows x SEQ), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, VOCAB, (rows, SEQ), generator=g) for _ in range(replicas)] for _ in range(steps)]


def reference_loss(ref, batches: list[torch.Tensor]) -> torch.Tensor:
    """The job's loss: the mean over replicas of each replica batch's HF loss (aux loss included)."""
    return torch.stack([ref(ids, labels=ids).loss for ids in batches]).mean()


def mean_over_replicas(loss: torch.Tensor) -> float:
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=smp.get_rdp_process_group())
    return mean.item() / smp.rdp_size()


def check_first_step(ref, model, batches: list[torch.Tensor], what: str) -> torch.Tensor:
    """Logits, loss (aux loss included) and aux loss of this replica's batch equal HF's; return
    the distributed loss."""
    mine = batches[smp.rdp_rank()]
    out = model(mine, labels=mine)
    with torch.no_grad():
        want = ref(mine, labels=mine)
    assert_close(out.logits, want.logits, f"{what} logits")
    assert_close(out.aux_loss, want.aux_loss, f"{what} aux loss")
    assert_close(out.loss, want.loss, f"{what} loss")
    return out.loss


def train_like_one_process(ref, model, steps: list[list[torch.Tensor]], what: str, lr: float = 1e-2,
                           optimizer=torch.optim.AdamW) -> None:
    """``optimizer`` steps (AdamW; SGD shows a wrong gradient average in the loss, its update being
    the gradient) of a ``DistributedModel`` (each replica its own batch) against the reference:
    the first step's logits, losses and every gradient, then every step's mean loss."""
    opt_ref = optimizer(ref.parameters(), lr=lr)
    opt = smp.DistributedOptimizer(optimizer(model.parameters(), lr=lr))
    for step, batches in enumerate(steps):
        mine = batches[smp.rdp_rank()]
        loss = check_first_step(ref, model, batches, what) if step == 0 else model(mine, labels=mine).loss
        want = reference_loss(ref, batches)
        want.backward()
        model.backward(loss)
        if step == 0:
            assert_grads_match(ref, model, rerun=lambda twin: reference_loss(twin, batches))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        got = mean_over_replicas(loss)
        rel = abs(got - want.item()) / abs(want.item())
        assert rel < training_rtol(step), f"{what} step {step}: loss {got} vs one process {want.item()} (rel {rel:.1e})"


def distributed_copy(ref, **config):
    """``smp.init(config)``, then a ``DistributedModel`` of a copy of ``ref``."""
    smp.init(config)
    return smp.DistributedModel(copy.deepcopy(ref))


def average_like_data_parallel(model) -> None:
    """What a data-parallel wrapper does to a ``transform``ed model's gradients: dense ones averaged
    over every data-parallel rank, experts over the ranks holding the same experts."""
    from modelparallel.expert import is_expert_parameter
    from modelparallel.tp.layout import local_grad

    for p in model.parameters():
        g = local_grad(p)
        if g is None:
            continue
        group = smp.CommGroup.EDP_GROUP if is_expert_parameter(p) else smp.CommGroup.RDP_GROUP
        dist.all_reduce(g, group=smp.runtime.current().group(group))
        g /= len(smp.runtime.current().ranks(group))


def train_transformed_like_one_process(ref, model, steps, what: str, lr: float = 1e-2, grads: bool = True,
                                       reference=reference_loss) -> None:
    """AdamW steps of a ``transform``ed model (each replica its own batch; gradients averaged by
    ``average_like_data_parallel`` unless an FSDP wrapper does it: ``grads=False``) against the
    reference's ``reference(ref, batches)`` loss."""
    from reference import _assert_module_grads_match

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step, batches in enumerate(steps):
        mine = batches[smp.rdp_rank()]
        loss = model(mine, labels=mine).loss
        want = reference(ref, batches)
        want.backward()
        loss.backward()
        if grads:
            average_like_data_parallel(model)
            if step == 0:
                _assert_module_grads_match(ref, model, rerun=lambda twin: reference(twin, batches))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        got = mean_over_replicas(loss)
        rel = abs(got - want.item()) / abs(want.item())
        assert rel < training_rtol(step), f"{what} step {step}: loss {got} vs one process {want.item()} (rel {rel:.1e})"


def train_on_tensor_parallel_unions(ref, model, steps: int, tp: int) -> None:
    """SageMaker's default ``prescaled_batch`` false: each rank brings its own batch and each TP
    group (``tp`` consecutive ranks) computes on their union, one replica's batch. AdamW steps
    against the reference on every group's union; every step's loss averaged over the world."""
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step, per_rank in enumerate(replica_batches(steps, smp.size())):
        unions = [torch.cat(per_rank[r:r + tp]) for r in range(0, smp.size(), tp)]
        want = reference_loss(ref, unions)
        loss = model(per_rank[smp.rank()], labels=per_rank[smp.rank()]).loss
        want.backward()
        model.backward(loss)
        for o in (optimizer, opt_ref):
            o.step()
            o.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        got = mean.item() / smp.size()
        assert abs(got - want.item()) / abs(want.item()) < training_rtol(step), (step, got, want.item())
