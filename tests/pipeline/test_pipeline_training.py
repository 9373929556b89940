"""Pipeline parallelism trains exactly like one Hugging Face process on the global batch.

Each case splits a tiny model over 2 or 4 pipeline stages (with tensor or data parallelism
beside), runs ``@smp.step`` with both schedules and several microbatch counts, and compares
with an untouched HF model in fp32: every local gradient after one step, the weights after one
SGD step, the losses of 5 AdamW steps, and that weights tied across stages (GPT-2's ``wte`` and
``lm_head``) stay identical; a loss the step function computes from the logits gives HF's
gradients, and the logits it returns reach every stage.

A gradient mismatch means the stage split (modelparallel/pipeline/split.py), the hooks at the
stage's edges (pipeline/stage.py), the recorded loss and its scaling (pipeline/runner.py,
``DistributedModel.backward``) or the tied-gradient sum (pipeline/ties.py) is wrong; a loss
mismatch with right gradients points at the StepOutput exchange (pipeline/outputs.py).
"""

import copy

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import harness
import modelparallel as smp
from reference import NOISE_FACTOR, _fp32_gradient_noise, as_hf, gathered, tolerance, training_rtol

VOCAB, ROWS, SEQ, LAYERS = 61, 8, 8, 4


def build(arch: str):
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=LAYERS, n_head=4, vocab_size=VOCAB, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=16))
    return BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def my_rows(ids: torch.Tensor) -> torch.Tensor:
    """SageMaker's sharding with prescaled_batch false: by dp rank (every TP rank its own rows)."""
    return ids.chunk(smp.dp_size())[smp.dp_rank()]


def setup(arch, pp, tp, microbatches, schedule, **extra):
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": microbatches,
              "pipeline": schedule, "random_seed": 1, **extra})
    torch.manual_seed(1)
    ref = build(arch)
    return ref, smp.DistributedModel(copy.deepcopy(ref))


@smp.step
def train_step(model, ids):
    out = model(ids, labels=ids)
    model.backward(out.loss)
    return out.loss


def assert_stage_grads_match(ref, model, ids) -> dict[str, float]:
    """Every parameter this rank holds has HF's gradient (within reordered rounding, plus the
    fp32 reference's own distance from an fp64 recomputation for gradients that are zero in
    exact arithmetic, such as attention's key bias). Returns each name's tolerance."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    noise = _fp32_gradient_noise(ref, lambda twin: twin(ids, labels=ids).loss)
    atols = {}
    for name, p in model.module.named_parameters():
        expected = want[name].grad
        assert p.grad is not None, f"{name}: no gradient"
        atol = tolerance(expected) + NOISE_FACTOR * noise.get(want_name(ref, name), 0.0)
        torch.testing.assert_close(as_hf(p.grad, expected), expected, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"grad {n}: {m}")
        atols[name] = atol
    return atols


def want_name(ref, name: str) -> str:
    """The name ``named_parameters()`` lists a tied parameter under (GPT-2's ``lm_head.weight``
    is ``transformer.wte.weight`` there)."""
    names = dict(ref.named_parameters(remove_duplicate=False))
    return next(n for n, p in ref.named_parameters() if p is names[name])


def one_sgd_step(arch, pp, tp, microbatches, schedule, **extra):
    """Gradients and SGD-updated weights of one step equal HF's; returns (names held, loss, HF loss)."""
    ref, model = setup(arch, pp, tp, microbatches, schedule, **extra)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = global_batch(0)
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    loss = train_step(model, my_rows(ids))
    assert isinstance(loss, smp.StepOutput) and len(loss.outputs) == microbatches
    grad_atol = assert_stage_grads_match(ref, model, ids)
    opt.step()
    ref_opt.step()
    want = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.module.named_parameters():  # the update is lr x the gradient
        atol = tolerance(want[name].detach()) + 0.1 * grad_atol[name]
        torch.testing.assert_close(as_hf(p.detach(), want[name]), want[name].detach(), rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"weight {n}: {m}")
    names = sorted(n for n, _ in model.module.named_parameters(remove_duplicate=False))
    return names, loss.reduce_mean().item(), ref_loss.item()


CASES = [  # (world, arch, pp, tp, microbatches, schedule)
    pytest.param(2, "gpt2", 2, 1, 2, "interleaved", marks=pytest.mark.smoke),
    (2, "gpt2", 2, 1, 4, "interleaved"),
    (2, "gpt2", 2, 1, 2, "simple"),
    (2, "gpt2", 2, 1, 4, "simple"),
    (2, "gpt2", 2, 1, 1, "simple"),
    (2, "gpt2", 2, 1, 1, "interleaved"),
    (2, "llama", 2, 1, 2, "interleaved"),
    (2, "bert", 2, 1, 4, "simple"),
    (4, "gpt2", 4, 1, 4, "interleaved"),
    (4, "gpt2", 4, 1, 2, "simple"),
    (4, "llama", 4, 1, 8, "interleaved"),
    (4, "gpt2", 2, 2, 2, "interleaved"),
    (4, "bert", 2, 2, 2, "simple"),
    (4, "gpt2", 2, 1, 2, "interleaved"),
    (4, "llama", 2, 1, 4, "simple"),
]


@pytest.mark.parametrize("world, arch, pp, tp, microbatches, schedule", CASES)
def test_one_step_equals_one_process(world, arch, pp, tp, microbatches, schedule):
    out = harness.run(world, one_sgd_step, arch, pp, tp, microbatches, schedule)
    held = {n for names, _, _ in out for n in names}
    want = {n for n, _ in build(arch).named_parameters(remove_duplicate=False)}
    assert held == want, f"parameters no stage holds: {sorted(want - held)}; unknown: {sorted(held - want)}"
    assert all(len(set(names)) < len(want) for names, _, _ in out), "a stage holds the whole model"
    dp = world // (pp * tp)
    mean = sum(loss for _, loss, _ in out) / world  # every rank's StepOutput (last stage's, sent on)
    assert abs(mean - out[0][2]) <= training_rtol(0) * abs(out[0][2]), (mean, out[0][2], dp)


def test_sequence_parallel_stages_equal_one_process():
    """pp 2 x tp 2 with sequence_parallel: the activation a stage receives is its first block's
    input before sequence parallelism cuts it (pipeline/stage.py's hook runs first)."""
    out = harness.run(4, one_sgd_step, "llama", 2, 2, 2, "interleaved", sequence_parallel=True)
    assert abs(out[0][1] - out[0][2]) <= training_rtol(0) * abs(out[0][2]), out[0][1:]


@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_active_microbatches_run_in_rounds(schedule):
    """8 microbatches in rounds of 2 (an in-flight limit): the same gradients."""
    out = harness.run(2, one_sgd_step, "gpt2", 2, 1, 8, schedule, active_microbatches=2)
    assert abs(out[0][1] - out[0][2]) <= training_rtol(0) * abs(out[0][2])


def adamw_steps(arch, pp, tp, microbatches, schedule, steps=5, **extra):
    """5 AdamW steps: each step's global loss equals HF's; tied copies stay bitwise equal."""
    ref, model = setup(arch, pp, tp, microbatches, schedule, **extra)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        ids = global_batch(step)
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = train_step(model, my_rows(ids)).reduce_mean()
        mean = smp.allgather(loss, smp.DP_GROUP)  # the global batch's loss: the mean of the dp ranks'
        losses.append((sum(mean).item() / len(mean), ref_loss.item()))
        opt.step()
        opt.zero_grad()
    tied = {n: gathered(p.detach()) for n, p in model.module.named_parameters() if n in ("lm_head.weight",
                                                                                       "transformer.wte.weight")}
    return losses, tied


@pytest.mark.parametrize("world, arch, pp, tp, microbatches, schedule", [
    (2, "gpt2", 2, 1, 2, "interleaved"),
    (4, "gpt2", 2, 2, 4, "simple"),
    (4, "llama", 4, 1, 4, "interleaved"),
    (4, "bert", 2, 1, 2, "interleaved"),
])
def test_adamw_steps_equal_one_process(world, arch, pp, tp, microbatches, schedule):
    out = harness.run(world, adamw_steps, arch, pp, tp, microbatches, schedule)
    for step, (loss, want) in enumerate(out[0][0]):
        assert abs(loss - want) <= training_rtol(step) * abs(want), (step, loss, want)
    copies = [t for _, tied in out for t in tied.values()]
    if arch == "gpt2":
        assert len(copies) == 2 * world // pp and all(torch.equal(copies[0], c) for c in copies), \
            "GPT-2's wte (first stage) and lm_head (last stage) must stay identical"


@smp.step
def custom_loss_step(model, ids):
    """The loss computed by the step function from the model's logits, not by the model."""
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    model.backward(loss)
    return loss, logits


def custom_loss(schedule):
    ref, model = setup("gpt2", 2, 1, 2, schedule)
    ids = global_batch(0)
    ref_logits = ref(ids).logits
    ref_loss = ref(ids, labels=ids).loss  # HF's causal loss is the same mean cross entropy
    ref_loss.backward()
    loss, logits = custom_loss_step(model, ids)
    assert_stage_grads_match(ref, model, ids)
    return loss.reduce_mean().item(), ref_loss.item(), logits.concat(), ref_logits.detach()


@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_custom_loss_in_the_step_function(schedule):
    for loss, ref_loss, logits, want in harness.run(2, custom_loss, schedule):  # both stages get the outputs
        assert abs(loss - ref_loss) <= training_rtol(0) * abs(ref_loss), (loss, ref_loss)
        torch.testing.assert_close(logits, want, rtol=0, atol=tolerance(want))
