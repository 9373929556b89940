"""Features that each have their own tests, combined as a SageMaker v1 script combines them:
gradient accumulation (``backward_passes_per_step`` over ``@smp.step`` calls of 2 microbatches) x
pipeline (x TP or x data parallel) x ``smp.set_activation_checkpointing`` x delayed init: one
step equals the plain model's from the same initial values.

A failure points at the microbatch scaling (``DistributedModel.backward``) or the pipeline's
recompute. Kept apart from ``test_combination_review.py`` (resume at another layout, and the
exports after it): no checkpoint is involved here.
"""

import pytest
import torch

import harness
import modelparallel as smp
from combination_jobs import _assert_equal, _batch, _full, _llama, _merged, _train_step
from reference import NOISE_FACTOR, _fp32_gradient_noise, count_block_runs, tolerance


def accumulated_step(layout, passes):
    """Llama built in ``smp.delay_param_initialization()``, split over the pipeline (and TP) ranks,
    each stage's decoder layers checkpointed by ``smp.set_activation_checkpointing``, ``passes``
    ``@smp.step`` calls of 2 microbatches each accumulated (``backward_passes_per_step``), one
    fused-AdamW step. Returns the losses, the gradients the step used, the weights after it and
    how often each local block ran (a forward and a recompute per microbatch when checkpointed)."""
    smp.init({**layout, "microbatches": 2, "delayed_parameter_initialization": True, "random_seed": 5})
    torch.manual_seed(5)
    with smp.delay_param_initialization():
        model = _llama()
    model = smp.DistributedModel(model, backward_passes_per_step=passes)
    smp.set_activation_checkpointing(model.module.model.layers)
    runs = count_block_runs(model.module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    initial = {n: _full(p) for n, p in model.module.named_parameters()}
    losses = []
    for k in range(passes):
        ids = _batch(k).chunk(smp.dp_size())[smp.dp_rank()]  # prescaled_batch false: rows by dp rank
        losses.append(sum(smp.allgather(_train_step(model, ids).reduce_mean(), smp.DP_GROUP)).item() / smp.dp_size())
    grads = {n: _full(p.grad) for n, p in model.module.named_parameters()}
    opt.step()
    return {"initial": initial, "losses": losses, "grads": grads, "runs": runs,
            "weights": {n: _full(p) for n, p in model.module.named_parameters()}}


@pytest.mark.parametrize("world, layout, passes", [
    (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, 2),
    (4, {"pipeline_parallel_degree": 2}, 2),  # pipeline x data parallel 2: the average after the second pass
])
def test_accumulated_checkpointed_pipeline_from_delayed_init_steps_like_one_process(world, layout, passes):
    out = harness.run(world, accumulated_step, layout, passes)
    merged = _merged(out)
    torch.manual_seed(5)
    eager = dict(_llama().named_parameters())
    assert merged["initial"].keys() == eager.keys()
    for name, p in eager.items():  # HF's init, each tensor its own draw (at pp > 1 not eager's draws)
        got = merged["initial"][name]
        assert abs(got.std() - p.std()) <= 0.25 * p.std() + 1e-6 and abs(got.mean() - p.mean()) <= 0.1 + 1e-6, name
        assert p.std() == 0 or not any(torch.equal(got, merged["initial"][other]) for other in eager if other != name
                                       and merged["initial"][other].shape == got.shape), f"{name} repeated"
    ref = _llama()  # the plain model from the initialized values
    named = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(merged["initial"][name])
    batches = [_batch(k) for k in range(passes)]
    for k, ids in enumerate(batches):
        loss = ref(ids, labels=ids).loss
        loss.backward()  # accumulated: the passes' gradients add up
        got = out[0]["losses"][k]
        assert abs(got - loss.item()) <= tolerance(loss.detach()), (k, got, loss.item())
    noise = _fp32_gradient_noise(ref, lambda twin: sum(twin(ids, labels=ids).loss for ids in batches))
    for name, p in named.items():
        torch.testing.assert_close(merged["grads"][name], p.grad, rtol=0,
                                   atol=tolerance(p.grad) + NOISE_FACTOR * noise.get(name, 0.0),
                                   msg=lambda m, n=name: f"grad {n}: {m}")
    for r in out:  # each local block: a forward and a recompute for each microbatch of each pass
        assert r["runs"] and set(r["runs"].values()) == {2 * 2 * passes}, r["runs"]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for name, p in named.items():
        p.grad = merged["grads"][name].clone()
    opt.step()
    for name, p in named.items():
        _assert_equal(merged["weights"][name], p.detach(), f"weight {name} after the step")
