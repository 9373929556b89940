"""``@smp.step`` and SageMaker's batch semantics, against one Hugging Face process on the whole
global batch: microbatch gradient accumulation, ``prescaled_batch`` false (each TP rank brings its
own batch, the group computes on the union) and true, ``StepOutput``, hooks,
``backward_passes_per_step`` and ``average_grads_across_microbatches``, bad input.

A failure in a gradient comparison means modelparallel/step.py (microbatch scaling, the deferred
data-parallel average), modelparallel/batch.py (the union's gather and its backward) or
``DistributedModel.backward`` in model_grads.py is wrong; the reference is an untouched HF model.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import harness
import modelparallel as smp
from reference import assert_close, assert_grads_match, training_rtol

WORLD_ROWS = 8  # the global batch: every configuration splits these rows over its ranks


def cfg():
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=16, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def global_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 61, (WORLD_ROWS, 8), generator=g)


def my_rows(ids: torch.Tensor, prescaled: bool) -> torch.Tensor:
    """SageMaker's data sharding: by dp rank (each rank its own rows), or by rdp rank when the
    batch is prescaled (the TP ranks of a group share rows)."""
    if prescaled:
        return ids.chunk(smp.rdp_size())[smp.rdp_rank()]
    return ids.chunk(smp.dp_size())[smp.dp_rank()]


def _pair(tp, microbatches, prescaled, **model_args):
    smp.init({"tensor_parallel_degree": tp, "microbatches": microbatches, "prescaled_batch": prescaled,
              "random_seed": 1})
    torch.manual_seed(1)
    ref = GPT2LMHeadModel(cfg())
    return ref, smp.DistributedModel(copy.deepcopy(ref), **model_args)


def step_matches_one_process(tp, microbatches, prescaled, loss_outside):
    """One step's gradients and outputs equal HF's on the whole global batch."""
    ref, model = _pair(tp, microbatches, prescaled)
    ids = global_batch()
    ref_out = ref(ids, labels=ids)
    ref_out.loss.backward()

    @smp.step
    def train_step(model, ids):
        if loss_outside:  # the loss of this rank's own rows, from the logits it got back
            logits = model(ids).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        else:
            out = model(ids, labels=ids)
            loss, logits = out.loss, out.logits
        model.backward(loss)
        return loss, {"logits": logits}

    mine = my_rows(ids, prescaled)
    loss, extra = train_step(model, mine)
    assert isinstance(loss, smp.StepOutput) and len(loss.outputs) == microbatches
    assert_grads_match(ref, model)
    if not loss_outside:  # with labels the logits stay vocabulary-sharded (checked elsewhere)
        return loss.reduce_mean().item(), ref_out.loss.item()
    rows = {tuple(r.tolist()) for r in mine}
    want = torch.stack([ref_out.logits[i] for i, r in enumerate(ids) if tuple(r.tolist()) in rows])
    assert_close(extra["logits"].concat(), want.detach(), what="logits of this rank's rows")
    assert not extra["logits"].concat().requires_grad, "detach_outputs=True detaches"
    return loss.reduce_mean().item(), ref_out.loss.item()


@pytest.mark.parametrize("world, tp, microbatches, prescaled, loss_outside", [
    pytest.param(2, 2, 1, False, False, marks=pytest.mark.smoke),
    (2, 2, 2, False, True),
    (2, 1, 2, False, False),
    (4, 2, 2, False, False),
    (4, 2, 1, False, True),
    (4, 2, 2, True, False),
])
def test_step_gradients_equal_one_process(world, tp, microbatches, prescaled, loss_outside):
    out = harness.run(world, step_matches_one_process, tp, microbatches, prescaled, loss_outside)
    mean = sum(loss for loss, _ in out) / world  # every rank's StepOutput mean, averaged
    want = out[0][1]
    assert abs(mean - want) <= training_rtol(0) * abs(want), (mean, want)


def accumulation_options():
    """backward_passes_per_step=2 averages over replicas only every second step;
    average_grads_across_microbatches=False sums microbatch gradients."""
    ref, model = _pair(1, 2, False, backward_passes_per_step=2, average_grads_across_microbatches=False)
    a, b = global_batch(1), global_batch(2)
    for ids in (a, b):
        ref(ids, labels=ids).loss.backward()  # 2 steps accumulated, each the global mean

    @smp.step
    def train_step(ids):
        out = model(ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    train_step(my_rows(a, False))
    local = [p.grad.clone() for p in model.parameters()]
    peers = smp.allgather(local[0], smp.DP_GROUP)
    assert not torch.equal(peers[0], peers[1]), "first of two passes: gradients must stay local"
    train_step(my_rows(b, False))
    # summed over 2 microbatches instead of averaged: twice the mean-loss gradient
    for p in ref.parameters():
        p.grad *= 2
    assert_grads_match(ref, model)


def test_backward_passes_per_step_and_microbatch_sum():
    harness.run(2, accumulation_options)


def hooks_and_helpers():
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(GPT2LMHeadModel(cfg()), trace_device="gpu", bucket_cap_mb=10,
                                 broadcast_buffers=False, gradient_as_bucket_view=True)
    calls = []
    model.register_post_partition_hook(lambda m, o: calls.append(("partition", m.partitioned)))
    handle = model.register_post_step_hook(lambda m, o: calls.append(("step", o)))
    assert handle is not None and not model.partitioned
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step(non_split_inputs=["scale"], input_split_axes={"ids": 0})
    def train_step(ids, scale):
        calls.append(("forward", smp.num_microbatches(), smp.is_tracing(), tuple(ids.shape), scale))
        loss = model(ids, labels=ids).loss * scale
        model.backward(loss)
        return loss

    train_step(global_batch()[:4], 1.0)
    train_step(global_batch()[:4], 1.0)
    model.register_post_step_hook(lambda m, o: calls.append(("late", o is opt)))
    assert model.get_module() is model.module
    assert {id(p) for p in model.local_parameters()} == {id(p) for p in model.module.parameters()}
    assert len(list(model.local_buffers())) == len(list(model.module.buffers()))
    assert next(iter(model.local_modules())) is model.module
    return [c if c[0] != "step" else ("step", c[1] is opt) for c in calls]


def test_hooks_run_where_sagemaker_runs_them():
    calls = harness.run(2, hooks_and_helpers)[0]
    fwd = ("forward", 2, False, (2, 8), 1.0)
    assert calls == [("partition", True), fwd, fwd, ("step", True), fwd, fwd, ("late", True)]


def bad_input():
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(GPT2LMHeadModel(cfg()))

    @smp.step
    def train_step(ids):
        model.backward(model(ids, labels=ids).loss)

    errors = []
    try:
        train_step(global_batch()[:3])
    except ValueError as e:
        errors.append(str(e))
    try:
        smp.step(non_split_inputs=["mask"])(lambda ids: ids)
    except ValueError as e:
        errors.append(str(e))
    try:
        smp.DistributedModel(GPT2LMHeadModel(cfg()), backward_passes_per_step=0)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_bad_input_named():
    errors = harness.run(2, bad_input)[0]
    assert "argument 'ids' has size 3 along axis 0, which 2 microbatches do not divide" in errors[0]
    assert "non_split_inputs=...) names ['mask']" in errors[1]
    assert "backward_passes_per_step must be an integer >= 1, got 0" in errors[2]


def test_step_output_reductions():
    out = smp.StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])])
    assert out.reduce_mean().tolist() == [2.0, 4.0] and out.reduce_sum().tolist() == [4.0, 8.0]
    assert out.concat().tolist() == [1.0, 2.0, 3.0, 6.0] and out.stack().shape == (2, 2)
