"""SageMaker v2's three fine-tuning recipes, written as the page writes them (only the import of
``torch.sagemaker`` changed to ``modelparallel``), on CPU ranks.

(a) small model: ``transform(model, load_state_dict_from_rank0=True)`` then FSDP;
(b) large model: rank 0 ``from_pretrained``, the others ``init_empty_weights()``, ``transform``,
    ``DelayedParamIniter`` on ranks != 0, FSDP with ``param_init_fn`` inside
    ``validate_params_and_buffers_inited()``;
(c) FSDP-only delayed init, no ``transform``.

PyTorch's FSDP1 refuses ``sync_module_states=True`` with CPU parameters (its own check, tested
below so a PyTorch change shows up here); on CPU the recipes therefore run with
``sync_module_states=torch.cuda.is_available()``. For (a) and (b) that changes nothing:
``transform`` already gave every rank its shards of rank 0's weights, which the tests check
before FSDP sees the model, and training then matches one process. A failure in the shard check
points at transform.py's rank-0 sync; in training at the FSDP composition (see test_v2_fsdp.py);
in (b)'s ``noop`` check at delayed_param.py initializing a model that already holds weights.
"""

import functools
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

import harness
import modelparallel as smp
from modelparallel.expert.config import MoEConfig
from modelparallel.materialize import meta
from modelparallel.delayed_param import DelayedParamIniter
from modelparallel import transform
from reference import as_hf
from test_v2_fsdp import llama_cfg, train_and_compare

sys.path.insert(0, str(Path(__file__).parent / "expert"))  # the MoE reference (tests/expert/moe_reference.py)

AutoModelForCasalLM = AutoModelForCausalLM  # the page's spelling of the class name
SYNC = torch.cuda.is_available()  # FSDP1 refuses sync_module_states with CPU parameters


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(7)
    LlamaForCausalLM(llama_cfg()).save_pretrained(path)
    return str(path)


def fsdp_args():
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return dict(auto_wrap_policy=policy, device_id=torch.device("cpu"), device_mesh=smp.dp_mesh(),
                use_orig_params=True)


def assert_shards_of_pretrained(model, ref):
    for name, p in model.named_parameters():
        assert not meta.is_meta(p), name
        torch.testing.assert_close(as_hf(p, ref.get_parameter(name)), ref.get_parameter(name), rtol=0, atol=0)
    for name, b in ref.named_buffers():
        assert torch.equal(model.get_buffer(name), b), name


def recipe_a(path, tp):
    smp.init({"tensor_parallel_degree": tp})
    ref = AutoModelForCausalLM.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, low_cpu_mem_usage=True)
    # Transform model while loading state dictionary from rank 0.
    tp_model = transform(model, load_state_dict_from_rank0=True)
    assert_shards_of_pretrained(tp_model, ref)
    # Wrap with FSDP.
    model = FSDP(
        tp_model,
        **fsdp_args(),
        sync_module_states=SYNC,
    )
    ref.train()
    train_and_compare(ref, model)


@pytest.mark.parametrize("tp,world", [(2, 4), (1, 2)])
def test_recipe_a_small_model_transform_then_fsdp(pretrained, tp, world):
    harness.run(world, recipe_a, pretrained, tp)


def recipe_b(path, tp):
    smp.init({"tensor_parallel_degree": tp})
    ref = AutoModelForCausalLM.from_pretrained(path)
    # Create one instance of model without delayed param
    # on CPU, on one rank.
    if dist.get_rank() == 0:
        model = AutoModelForCasalLM.from_pretrained(path, low_cpu_mem_usage=True)
    else:
        with init_empty_weights():
            model = AutoModelForCasalLM.from_config(AutoConfig.from_pretrained(path))
    # Transform model while loading state dictionary from rank 0
    model = transform(model, load_state_dict_from_rank0=True)
    if dist.get_rank() != 0:
        # For fine-tuning, delayed parameter on non-zero ranks
        delayed_initer = DelayedParamIniter(model)
    else:
        delayed_initer = None
    assert delayed_initer is None or delayed_initer.noop
    assert_shards_of_pretrained(model, ref)
    with (
        delayed_initer.validate_params_and_buffers_inited() if delayed_initer else nullcontext()
    ):
        # Wrap the model with FSDP
        model = FSDP(
            model,
            **fsdp_args(),
            sync_module_states=SYNC,
            param_init_fn=delayed_initer.get_param_init_fn() if delayed_initer else None
        )
    ref.train()
    train_and_compare(ref, model)


@pytest.mark.parametrize("tp,world", [(2, 4), (1, 2)])
def test_recipe_b_large_model_rank0_transform_delayed_fsdp(pretrained, tp, world):
    harness.run(world, recipe_b, pretrained, tp)


def recipe_c(path):
    """Without ``sync_module_states`` (refused on CPU) ranks != 0 keep their own initialization:
    check that FSDP's ``param_init_fn`` initialized every meta tensor exactly as HF does."""
    smp.init({"tensor_parallel_degree": 1})
    if dist.get_rank() == 0:
        model = AutoModelForCasalLM.from_pretrained(path, low_cpu_mem_usage=True)
    else:
        with init_empty_weights():
            model = AutoModelForCasalLM.from_config(AutoConfig.from_pretrained(path))
        delayed_initer = DelayedParamIniter(model)
        assert not delayed_initer.noop
    model = FSDP(
        model,
        **fsdp_args(),
        sync_module_states=SYNC,
        param_init_fn=delayed_initer.get_param_init_fn() if dist.get_rank() > 0 else None
    )
    assert not meta.has_meta(model)
    eager = LlamaForCausalLM(llama_cfg())
    with FSDP.summon_full_params(model):
        inner = model.module
        assert torch.equal(inner.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
        for name, p in inner.named_parameters():
            q = name.replace("_fsdp_wrapped_module.", "")
            if q.endswith("norm.weight"):
                assert torch.equal(p, torch.ones_like(p)), q
            else:  # HF's normal(0, initializer_range) init, not uninitialized memory
                std = eager.config.initializer_range
                assert abs(p.std().item() - std) < 0.25 * std, (q, p.std().item())
    if dist.get_rank() > 0:
        assert not delayed_initer._unwritten


def test_recipe_c_fsdp_only_delayed_init(pretrained):
    harness.run(2, recipe_c, pretrained)


def sync_module_states_refused_on_cpu():
    smp.init({"tensor_parallel_degree": 1})
    model = LlamaForCausalLM(llama_cfg())
    with pytest.raises(ValueError, match="CPU parameters or buffers when `sync_module_states=True`"):
        FSDP(model, device_id=torch.device("cpu"), sync_module_states=True)


def test_pytorch_refuses_sync_module_states_on_cpu():
    """Why the recipes above run with ``sync_module_states=False`` on CPU: PyTorch's own check.
    If this starts failing, PyTorch allows it and the recipes can run with ``True``."""
    harness.run(2, sync_module_states_refused_on_cpu)


def meta_again_named():
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_cfg()) if dist.get_rank() == 0 else None
    if model is None:
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_cfg())
    model = transform(model, load_state_dict_from_rank0=True)
    assert DelayedParamIniter(model).noop
    with torch.device("meta"):
        model.model.norm = type(model.model.norm)(64)
    with pytest.raises(smp.MetaTensorError, match=r"filled from rank 0.*: model\.norm\.weight$"):
        DelayedParamIniter(model)


def test_delayed_initer_names_meta_tensors_of_a_model_filled_from_rank0():
    harness.run(2, meta_again_named)


def recipe_moe_delayed(path, ep):
    """The v2 scripts' Mixtral path with delayed parameters when fine-tuning: rank 0 builds the
    pretrained model, the others build it in ``init_empty_weights()`` and call ``transform``
    inside that block too (accelerate's parameter registration is active there); every rank
    then holds its shards of rank 0's weights and trains like one process."""
    from moe_reference import replica_batches, train_transformed_like_one_process

    smp.init({"expert_parallel_degree": ep, "prescaled_batch": True})
    ref = AutoModelForCausalLM.from_pretrained(path)
    moe_config = MoEConfig(smp_moe=True, random_seed=1, moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.05,
                           moe_z_loss_coeff=0.0, use_cpu_initialization=dist.get_rank() == 0)
    if dist.get_rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(path)
        model = transform(model, config=moe_config, load_state_dict_from_rank0=True)
    else:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        with init_empty_weights():
            model = transform(model, config=moe_config, load_state_dict_from_rank0=True)
        assert DelayedParamIniter(model).noop
    assert_shards_of_pretrained(model, ref)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MixtralDecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    train_transformed_like_one_process(ref, model, replica_batches(3, smp.rdp_size()), "mixtral delayed", grads=False)


def test_recipe_moe_transform_inside_init_empty_weights(tmp_path):
    from moe_reference import reference_model

    reference_model("mixtral").save_pretrained(tmp_path)
    harness.run(2, recipe_moe_delayed, str(tmp_path), 2)
