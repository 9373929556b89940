"""PyTorch FSDP1 (``FullyShardedDataParallel`` with an auto-wrap policy on the decoder layer
class) over SageMaker v2's ``smp.transform`` at tensor-parallel degree 2, with PyTorch's
activation checkpoint wrappers around the blocks: put on before ``transform`` (set aside while it
shards, ``activations/wrappers.py``), between ``transform`` and FSDP1, or after FSDP1 (PyTorch's
usual recipe). Against one Hugging Face process with the same checkpointing on the whole batch:
SGD steps' losses, the first step's update of every weight (its gradient times the learning rate,
read back whole through FSDP1's full state dict as the v2 scripts export), and two runs of each
block's region per step (forward + recompute).

A failure in ``transform`` means the wrappers were not set aside; one run per step, that
checkpointing silently did nothing; a wrong update only with one order, how FSDP1's units and
the wrappers nest (``CheckpointWrapper(FSDP(block))`` before FSDP1, ``FSDP(CheckpointWrapper(block))``
after it) meets the layout of ``sagemaker/v2/fsdp1.py``.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp
from modelparallel.activations.wrappers import INNER
from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer
from reference import (NOISE_FACTOR, _fp32_gradient_noise, count_block_runs, gathered, token_batches, tolerance,
                       training_rtol)

VOCAB, STEPS, LR = 101, 2, 0.1
UNITS = {"hf": LlamaDecoderLayer, "smp": TransformerLayer}
"""The block class FSDP1's policy names, and the v2 scripts' choices: SageMaker's block class and
PyTorch's reentrant checkpoint (the default is PyTorch's non-reentrant one)."""


def _checkpoint(model, impl: CheckpointImpl) -> None:
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: isinstance(m, LlamaDecoderLayer))


def _hf_name(name: str) -> str:
    return name.replace(f"{INNER}.", "")


def _whole_weights(model) -> dict[str, torch.Tensor] | None:
    """FSDP1's full state dict as the v2 scripts export it: whole HF tensors on rank 0 (None elsewhere)."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
        state = model.state_dict()
    return state if dist.get_rank() == 0 else None


def _assert_updates_match(before, after, ref_grads, noise) -> None:
    """Each weight moved by -LR x the reference's gradient, up to the gradient's rounding (as
    ``assert_grads_match`` allows) and the rounding of the two subtractions on the weight's scale."""
    assert after.keys() == before.keys(), sorted(set(after) ^ set(before))
    for name, w0 in before.items():
        grad = ref_grads[name]
        eps = torch.finfo(w0.dtype).eps
        atol = LR * (tolerance(grad) + NOISE_FACTOR * noise.get(name, 0.0)) + 2 * eps * w0.abs().max().item()
        torch.testing.assert_close(w0 - after[name], LR * grad, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"update of {n}: {m}")


def _unwrapped_copy(ref):
    """A copy of ``ref`` without its checkpoint wrappers (for the orders that wrap later)."""
    model = copy.deepcopy(ref)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = layer._modules[INNER]
    return model


def checkpointed_fsdp1(order: str, use_orig_params: bool, unit: str = "hf"):
    """``order``: where PyTorch's wrappers go ("before_transform", "before_fsdp", "after_fsdp");
    ``unit``: the block class FSDP1's policy names (``UNITS``), "smp" with the reentrant checkpoint."""
    impl = CheckpointImpl.REENTRANT if unit == "smp" else CheckpointImpl.NO_REENTRANT
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=64, use_cache=False))
    _checkpoint(ref, impl)
    model = copy.deepcopy(ref) if order == "before_transform" else _unwrapped_copy(ref)
    model = smp.transform(model)
    if order == "before_fsdp":
        _checkpoint(model, impl)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={UNITS[unit]})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    assert len(FSDP.fsdp_modules(model)) == 1 + len(ref.model.layers), "each block its own FSDP1 unit"
    if order == "after_fsdp":
        _checkpoint(model, impl)
    runs = count_block_runs(model)
    before = {k: v.clone() for k, v in ref.state_dict().items()}  # HF names: the wrappers drop theirs
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rank, replicas = smp.rdp_rank(), smp.rdp_size()
    for step, ids in enumerate(token_batches(VOCAB, STEPS)):
        want = ref(ids, labels=ids).loss
        want.backward()
        mine = ids[rank * len(ids) // replicas:(rank + 1) * len(ids) // replicas]
        loss = model(mine, labels=mine).loss
        loss.backward()
        if step == 0:
            ref_grads = {_hf_name(n): p.grad.clone() for n, p in ref.named_parameters()}
            noise = _fp32_gradient_noise(ref, lambda twin: twin(ids, labels=ids).loss)
            noise = {_hf_name(n): v for n, v in noise.items()}
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        if step == 0 and (after := _whole_weights(model)) is not None:
            _assert_updates_match(before, after, ref_grads, noise)
        mean = gathered(loss.detach()).clone()
        dist.all_reduce(mean, group=smp.get_rdp_process_group())
        rel = abs(mean.item() / replicas - want.item()) / abs(want.item())
        assert rel < training_rtol(step), f"step {step}: loss {mean.item() / replicas} vs {want.item()} (rel {rel:.1e})"
    assert len(runs) == 2 and all(n == 2 * STEPS for n in runs.values()), runs


@pytest.mark.parametrize("order, use_orig_params, unit", [
    ("before_transform", True, "hf"), ("before_transform", False, "hf"), ("before_transform", True, "smp"),
    ("before_fsdp", True, "hf"), ("after_fsdp", True, "hf"), ("after_fsdp", False, "smp")])
def test_checkpointed_fsdp1_over_tp2_trains_like_one_process(order, use_orig_params, unit):
    harness.run(4, checkpointed_fsdp1, order, use_orig_params, unit)
