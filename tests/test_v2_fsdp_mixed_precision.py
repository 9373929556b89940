"""FSDP1's ``mixed_precision`` over ``smp.transform``'s output, as SageMaker v2 scripts pass it
(``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)``), against the same
FSDP1 call over the plain Hugging Face model: the same numerics (bf16 compute and gradient
reduction, fp32 weights updated by SGD), with tensor parallelism as the only difference.

4 ranks: TP=2 x 2 data-parallel replicas for ours; the plain model is sharded over all 4, each
rank on the rows of its replica (so its gradient average is the replicas' average). SGD, whose
update is proportional to the gradient: an average over the wrong ranks, a gradient reduced
twice or not at all, or a TP shard updated with another shard's gradient moves the weights by
a multiple of the right update, far outside the rounding bound below.

Where to look: a failure only here, not in ``test_v2_fsdp.py`` (fp32) -> how FSDP1 casts the
flat parameter's shards to ``param_dtype`` and back over DTensors (``sagemaker/v2/fsdp1*.py``).
"""

import copy
import functools

import torch
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp
from test_v2_fsdp import batches, llama_cfg

STEPS, LR = 3, 0.5
LAYERS = llama_cfg().num_hidden_layers
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)


def _wrapped(module):
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FSDP(module, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True,
                mixed_precision=BF16)


def _train(model) -> tuple[list[float], dict]:
    """``STEPS`` SGD steps on this rank's replica rows: (losses, full fp32 weights on rank 0).
    Every linear layer of the blocks must compute in bf16 (a policy dropped on the way would
    train in fp32, within the rounding bound of bf16's result)."""
    seen = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.update({args[0].dtype, out.dtype}))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    rank, replicas = smp.rdp_rank(), smp.rdp_size()
    losses = []
    for ids in batches(STEPS):
        mine = ids[rank * len(ids) // replicas:(rank + 1) * len(ids) // replicas]
        loss = model(mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert seen == {torch.bfloat16}, f"linear layers computed in {seen}"
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True,
                                                                                        offload_to_cpu=True)):
        weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    return losses, weights


def ours_and_plain():
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(llama_cfg())
    start = {k: v.float().clone() for k, v in ref.state_dict().items()}
    ours = _train(_wrapped(smp.transform(copy.deepcopy(ref))))
    plain = _train(_wrapped(copy.deepcopy(ref)))
    return ours, plain, start


def test_fsdp1_bf16_mixed_precision_over_transform_equals_it_over_the_plain_model():
    (losses, weights), (want_losses, want_weights), start = harness.run(4, ours_and_plain)[0]
    eps = torch.finfo(torch.bfloat16).eps
    # Both compute in bf16; TP adds at most two roundings per layer where a row-parallel layer's
    # two half sums are rounded and then added (embedding and head: one each), each up to eps
    # relative, so the loss and every gradient, hence every SGD move, agree within that many eps.
    bound = 2 * (LAYERS + 2) * eps
    for a, b in zip(losses, want_losses):
        assert abs(a - b) <= bound * abs(b), (losses, want_losses)
    assert weights.keys() == want_weights.keys()
    for name, w in want_weights.items():
        moved = (w - start[name]).abs().max().item()
        if name.endswith("rotary_emb.inv_freq"):
            continue
        assert moved > 0, f"{name} never changed: no gradient reached it"
        torch.testing.assert_close(weights[name], w, rtol=0, atol=bound * moved + torch.finfo(torch.float32).eps *
                                   STEPS * w.abs().max().item(), msg=lambda m: f"{name}: {m}")
