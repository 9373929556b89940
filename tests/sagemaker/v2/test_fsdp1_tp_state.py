"""Resuming PyTorch FSDP1 over ``smp.transform``'s TP shards through ``get_state_dict`` /
``dcp.save`` / ``dcp.load`` / ``set_state_dict``, as SageMaker v2 scripts checkpoint.

The resumed model continues in the same processes with the same data and the same operations
as the uninterrupted one, from a state that must be restored exactly, so the next losses must be
bitwise equal. A failure at TP=2 only means the optimizer moments of TP-sharded parameters come
back in the wrong block (FSDP1 cutting a flat range out of the global tensor instead of the
TP-local one; ``sagemaker/v2/fsdp1_tp_state.py``); at both degrees, that DCP lost or mixed state.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import harness
import modelparallel as smp

SAVED_AT, MORE = 3, 2


def build():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = smp.transform(LlamaForCausalLM(cfg))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), device_mesh=smp.dp_mesh(),
                 use_orig_params=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, opt, step):
    ids = torch.randint(1, 128, (4, 10), generator=torch.Generator().manual_seed(step))
    per = 4 // smp.rdp_size()
    mine = ids[smp.rdp_rank() * per:(smp.rdp_rank() + 1) * per]
    loss = model(mine, labels=mine).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def local(sd, prefix=""):
    """Every tensor of a (nested) state dict, by dotted key, as this rank's local data."""
    out = {}
    for k, v in (sd.items() if isinstance(sd, dict) else enumerate(sd)):
        if isinstance(v, (dict, tuple)):
            out.update(local(v, f"{prefix}{k}."))
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def resume_and_continue(tp, path):
    smp.init({"tensor_parallel_degree": tp})
    model, opt = build()
    for step in range(SAVED_AT):
        train_step(model, opt, step)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = local(get_state_dict(model, opt))
    uninterrupted = [train_step(model, opt, s) for s in range(SAVED_AT, SAVED_AT + MORE)]

    model, opt = build()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.testing.assert_close(local(get_state_dict(model, opt)), saved, rtol=0, atol=0)
    resumed = [train_step(model, opt, s) for s in range(SAVED_AT, SAVED_AT + MORE)]
    assert resumed == uninterrupted, f"rank {dist.get_rank()}: resumed {resumed} vs uninterrupted {uninterrupted}"


@pytest.mark.parametrize("tp,world", [(2, 4), (1, 2)])
def test_fsdp1_dcp_resume_continues_bitwise(tp, world, tmp_path):
    harness.run(world, resume_and_continue, tp, str(tmp_path / "ckpt"))
