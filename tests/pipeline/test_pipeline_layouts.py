"""Pipeline parallelism composed with context and expert parallelism (``DistributedModel`` and
``@smp.step``), against one Hugging Face process on the same global batch: every gradient of the
first step, then the losses (and, under SGD, the weights) of a few more steps.

Under pipeline x context each stage runs the context-parallel forward pre-hook on the first
stage's inputs (global positions, shifted labels, the loss share), so a gradient mismatch on
the last stage points at the labels the hook sees there (pipeline/inputs.py, context/inputs.py);
a mismatch by a constant factor at the average over the data x context ranks
(``DistributedModel._finish_backward``, the pipeline's ``finish``). Under pipeline x expert each
stage's experts are sharded over the expert-parallel ranks of the same stage: a mismatch of
expert gradients only points at the experts left unsharded or averaged over the wrong ranks
(parallelize.py step 5, ``DistributedModel._replica_groups``).
"""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import harness
import modelparallel as smp
from modelparallel.expert import is_expert_parameter
from reference import NOISE_FACTOR, _fp32_gradient_noise, as_hf, tolerance, training_rtol

VOCAB, ROWS, SEQ = 61, 4, 8


def build(arch: str):
    """Two-block models: each of two stages holds one block."""
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=16))
    # HF's router without its auxiliary loss (a function of every stage's router logits); eager
    # experts and attention, which the fp64 twin measuring the reference's rounding needs
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                           max_position_embeddings=16, output_router_logits=False)
    config._attn_implementation = config._experts_implementation = "eager"
    return MixtralForCausalLM(config)


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def my_part(ids: torch.Tensor) -> torch.Tensor:
    """This rank's rows (by data-parallel replica; the ranks of a tensor-parallel group share
    theirs: ``prescaled_batch``), and its part of their sequences."""
    return smp.get_batch_for_cp_rank(ids.chunk(smp.rdp_size())[smp.rdp_rank()])


@smp.step
def train_step(model, ids):
    out = model(ids, labels=ids)
    model.backward(out.loss)
    return out.loss


def global_loss(loss: smp.StepOutput) -> float:
    """The global batch's loss: the mean over the data x context ranks of each one's share."""
    shares = smp.allgather(loss.reduce_mean(), smp.DP_GROUP)  # tensor-parallel ranks hold equal shares
    return sum(shares).item() / len(shares)


def assert_grads_match(ref, model, ids) -> dict[str, float]:
    """Every parameter this rank holds has HF's gradient (reordered rounding, plus the fp32
    reference's distance from fp64 for gradients zero in exact arithmetic); returns each
    parameter's tolerance."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    noise = _fp32_gradient_noise(ref, lambda twin: twin(ids, labels=ids).loss)
    shared = {id(p): n for n, p in ref.named_parameters()}
    atols = {}
    for name, p in model.module.named_parameters():
        expected = want[name].grad
        assert p.grad is not None, f"{name}: no gradient"
        atols[name] = tolerance(expected) + NOISE_FACTOR * noise.get(shared[id(want[name])], 0.0)
        torch.testing.assert_close(as_hf(p.grad, expected), expected, rtol=0, atol=atols[name],
                                   msg=lambda m, n=name: f"grad {n}: {m}")
    return atols


def train(arch: str, config: dict, optimizer: str, steps: int):
    """``steps`` steps of ``optimizer`` at ``config`` against HF; returns (losses, HF's losses,
    names of this rank's parameters, names of those sharded over the expert-parallel ranks)."""
    smp.init({"microbatches": 2, "random_seed": 1, "prescaled_batch": True, **config})
    torch.manual_seed(1)
    ref = build(arch)
    model = smp.DistributedModel(copy.deepcopy(ref))
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if optimizer == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt, ref_opt = smp.DistributedOptimizer(make(model.parameters())), make(ref.parameters())
    losses, want = [], []
    for step in range(steps):
        ids = global_batch(step)
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        losses.append(global_loss(train_step(model, my_part(ids))))
        want.append(ref_loss.item())
        atols = assert_grads_match(ref, model, ids) if step == 0 else None
        opt.step()
        ref_opt.step()
        if atols is not None and optimizer == "sgd":
            assert_weights_match(ref, model, atols)
        opt.zero_grad()
        ref_opt.zero_grad()
    names = sorted(n for n, _ in model.module.named_parameters())
    experts = sorted(n for n, p in model.module.named_parameters() if is_expert_parameter(p))
    return losses, want, names, experts


def assert_weights_match(ref, model, grad_atols: dict[str, float]) -> None:
    """After one SGD step: HF's weights, within their own rounding plus lr x the gradient's."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.module.named_parameters():
        atol = tolerance(want[name].detach()) + 0.1 * grad_atols[name]
        torch.testing.assert_close(as_hf(p.detach(), want[name]), want[name].detach(), rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"weight {n}: {m}")


CASES = [  # (world, arch, config, optimizer, steps)
    pytest.param(4, "gpt2", {"pipeline_parallel_degree": 2, "context_parallel_degree": 2}, "sgd", 2, id="pp2_cp2_gpt2"),
    pytest.param(4, "llama", {"pipeline_parallel_degree": 2, "context_parallel_degree": 2, "pipeline": "simple"},
                 "adamw", 3, id="pp2_cp2_llama"),
    pytest.param(4, "mixtral", {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2}, "sgd", 2,
                 id="pp2_ep2_mixtral_sgd"),
    pytest.param(4, "mixtral", {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2}, "adamw", 3,
                 id="pp2_ep2_mixtral_adamw"),
    pytest.param(8, "llama", {"pipeline_parallel_degree": 2, "context_parallel_degree": 2,
                              "tensor_parallel_degree": 2}, "adamw", 2, id="pp2_cp2_tp2_llama"),
]


@pytest.mark.parametrize("world, arch, config, optimizer, steps", CASES)
def test_trains_like_one_process(world, arch, config, optimizer, steps):
    out = harness.run(world, train, arch, config, optimizer, steps)
    for step, (loss, want) in enumerate(zip(*out[0][:2])):
        assert abs(loss - want) <= training_rtol(step) * abs(want), (step, loss, want)
    held = {n for _, _, names, _ in out for n in names}
    assert held == {n for n, _ in build(arch).named_parameters(remove_duplicate=False)}, "every parameter on some stage"
    assert all(len(names) < len(held) for _, _, names, _ in out), "a stage holds the whole model"
    if config.get("expert_parallel_degree", 1) > 1:
        assert all(experts for _, _, _, experts in out), "every stage's experts sharded over the ep ranks"


def refuses_the_auxiliary_loss():
    smp.init({"pipeline_parallel_degree": 2})
    model = build("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="output_router_logits True"):
        smp.DistributedModel(model)
    return True


def test_auxiliary_loss_across_stages_refused():
    """HF's load-balancing loss is one function of every layer's router logits: the last stage
    alone cannot compute it, so a model that asks for it is refused before anything runs."""
    assert harness.run(2, refuses_the_auxiliary_loss) == [True, True]
