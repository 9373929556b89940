"""PyTorch FSDP applied by the user to ``smp.transform``'s output, as SageMaker v2 scripts do.

Each data-parallel replica trains on half of the batch, the single-process HF model on all of it;
10 AdamW steps must give the same losses, and the first step the same gradients (where FSDP keeps
parameter names, not FSDP1's flat parameters). A failure only with FSDP1
points at how ``transform`` leaves parameters for FSDP's flattening (plain tensors at TP=1,
DTensors on the "tp" sub-mesh at TP>1, which FSDP1 handles when given ``device_mesh=smp.dp_mesh()``);
only with FSDP2 at the composition of ``fully_shard`` over "dp" with the TP shards; first-step
gradients off by a constant factor at a doubled or missing gradient average over "dp" (AdamW's
losses barely see a constant factor).
"""

import copy
import functools

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp
from modelparallel.training.dp import allreduce_gradients
from reference import assert_replicas_train_like_one_process, sharded, token_batches

STEPS = 10


def llama_cfg():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)


def batches(steps=STEPS):
    return token_batches(101, steps)


def train_and_compare(ref, model, clip=None, after_backward=None, compare_grads=True, steps=STEPS):
    """Losses of ``model`` (half batch per data-parallel replica, FSDP averaging gradients over
    "dp") against ``ref`` (full batch, one process), step by step; with ``clip``, both clip their
    gradients to that norm every step and the norms must agree."""

    def between(step):
        if after_backward is not None:
            after_backward()
        if clip is not None:
            norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm = smp.clip_grad_norm_(model.parameters(), clip)
            # a sum of ~10^4 squares in fp32 in another order: eps 1.2e-7 x sqrt(10^4) ~ 1e-5
            torch.testing.assert_close(norm, norm_ref, rtol=1e-5, atol=0, msg=lambda m: f"step {step}: {m}")

    assert_replicas_train_like_one_process(ref, model, batches(steps), after_backward=between,
                                           compare_grads=compare_grads and clip is None)


def transformed(tp, seed=0):
    smp.init({"tensor_parallel_degree": tp})
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(llama_cfg())
    model = smp.transform(copy.deepcopy(ref))
    return ref, model


def fsdp1_on_transform(tp, use_orig_params):
    ref, model = transformed(tp)
    if tp == 1:
        assert not any(isinstance(p, DTensor) for p in model.parameters()), "DTensor on a mesh of one rank"
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), device_mesh=smp.dp_mesh(),
                 use_orig_params=use_orig_params)
    train_and_compare(ref, model, compare_grads=False)  # flat parameters


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("tp,world", [(2, 4), (1, 2)])
def test_fsdp1_over_transform_trains_like_one_process(tp, world, use_orig_params):
    harness.run(world, fsdp1_on_transform, tp, use_orig_params)


def fsdp1_process_group(tp):
    ref, model = transformed(tp)
    model = FSDP(model, device_id=torch.device("cpu"), process_group=smp.get_rdp_process_group(),
                 use_orig_params=True)
    train_and_compare(ref, model, compare_grads=False)  # flat parameters


def test_fsdp1_with_process_group_at_tp1():
    harness.run(2, fsdp1_process_group, 1)


def fsdp2_on_transform(tp, clip=None):
    ref, model = transformed(tp)
    for layer in model.model.layers:
        fully_shard(layer, mesh=smp.dp_mesh())
    fully_shard(model, mesh=smp.dp_mesh())
    w = model.model.layers[0].mlp.gate_proj.weight
    assert isinstance(w, DTensor) and w.to_local().numel() == w.numel() // (tp * smp.rdp_size())
    train_and_compare(ref, model, clip=clip)


@pytest.mark.parametrize("tp,world", [pytest.param(2, 4, marks=pytest.mark.smoke), (1, 2)])
def test_fsdp2_over_transform_trains_like_one_process(tp, world):
    harness.run(world, fsdp2_on_transform, tp)


def test_clip_grad_norm_over_tp_fsdp_and_replicated_equals_one_process():
    """TP=2 x DP=2 with FSDP2: TP-sharded weights on ("dp", "tp"), norms (whole over "tp") too; a
    small max_norm so clipping really scales every step."""
    harness.run(4, fsdp2_on_transform, 2, clip=0.5)


def tp_only_clip():
    """TP without FSDP: TP-sharded DTensors on "tp", norms whole on every rank (``Replicate()``
    DTensors on "tp"), gradients averaged over "dp" by the library's data-parallel all-reduce."""
    ref, model = transformed(2)
    assert any(not sharded(p) for p in model.parameters())
    average = functools.partial(allreduce_gradients, list(model.parameters()), smp.get_rdp_process_group(), smp.rdp_size())
    train_and_compare(ref, model, clip=0.5, after_backward=average)


def test_clip_grad_norm_tp_sharded_and_whole_replicated():
    harness.run(4, tp_only_clip)


def fsdp1_clip_refused():
    ref, model = transformed(1)
    model = FSDP(model, device_id=torch.device("cpu"), device_mesh=smp.dp_mesh(), use_orig_params=True)
    ids = batches()[0]
    model(ids, labels=ids).loss.backward()
    with pytest.raises(NotImplementedError, match="flattened by FSDP1.*pass the FSDP module itself"):
        smp.clip_grad_norm_(model.parameters(), 1.0)


def test_clip_grad_norm_refuses_fsdp1_flat_shards():
    harness.run(2, fsdp1_clip_refused)


def fsdp1_full_export(path, use_orig_params):
    """The v2 scripts' full export: FSDP1's ``FULL_STATE_DICT`` with ``rank0_only`` and CPU offload,
    ``torch.save`` on rank 0 as ``pytorch_model.bin`` beside the config."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    ref, model = transformed(2)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
        state_dict = model.state_dict()
        if torch.distributed.get_rank() == 0:
            torch.save(state_dict, f"{path}/pytorch_model.bin")
            ref.config.save_pretrained(path)
    torch.distributed.barrier()
    return {k: v.clone() for k, v in ref.state_dict().items()} if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_full_export_at_tp2_holds_whole_tensors(tmp_path, use_orig_params):
    """Every exported tensor is the whole HF tensor (an odd vocabulary: no padding in the export),
    and ``from_pretrained`` of the export gives the original model's logits."""
    want = harness.run(2, fsdp1_full_export, str(tmp_path), use_orig_params)[0]
    exported = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert exported.keys() == want.keys()
    for name, tensor in exported.items():
        assert type(tensor) is torch.Tensor and torch.equal(tensor, want[name]), name
    loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    ref = LlamaForCausalLM(llama_cfg())
    ref.load_state_dict(want)
    ids = batches(1)[0]
    assert torch.equal(loaded(ids).logits, ref(ids).logits)
