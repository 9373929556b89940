"""A SageMaker v2 (``torch.sagemaker``) fine-tuning script, end to end, with one import changed.

The large-model recipe: rank 0 loads the pretrained model, the other ranks build it on the meta
device, ``tsm.transform(..., load_state_dict_from_rank0=True)`` shards it over the tensor-parallel
ranks (each rank receives only its shards), ``DelayedParamIniter`` on ranks != 0, PyTorch FSDP
over the data-parallel mesh, activation checkpointing with PyTorch's own wrapper, a few AdamW
steps, a ``torch.distributed.checkpoint`` checkpoint (resumed when the script runs again), and an
export to a directory ``from_pretrained`` loads.

    torchrun --nproc-per-node 4 examples/smp_v2_finetune.py --out runs/v2 --tp 2 --steps 6 --stop-after 3
    torchrun --nproc-per-node 4 examples/smp_v2_finetune.py --out runs/v2 --tp 2 --steps 6   # resumes at step 3

No hub access: the "pretrained" model is a tiny Llama that rank 0 builds and saves first.
"""

import argparse
import functools
import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import init_empty_weights
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import modelparallel as tsm  # was: import torch.sagemaker as tsm
from modelparallel.delayed_param import DelayedParamIniter  # was: torch.sagemaker.delayed_param


def make_pretrained(path: Path) -> None:
    """Stand-in for a downloaded checkpoint: a tiny Llama saved with ``save_pretrained``."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def build(model_dir: str):
    """The seed's large-model recipe: rank 0 loads, the others stay empty until transform."""
    if dist.get_rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(model_dir, low_cpu_mem_usage=True)
    else:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model = tsm.transform(model, load_state_dict_from_rank0=True)
    delayed_initer = DelayedParamIniter(model) if dist.get_rank() != 0 else None
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    on_gpu = torch.cuda.is_available()
    with delayed_initer.validate_params_and_buffers_inited() if delayed_initer else nullcontext():
        model = FSDP(
            model,
            auto_wrap_policy=policy,
            device_mesh=tsm.dp_mesh(),  # FSDP over the data-parallel ranks, TP inside
            device_id=torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"),
            use_orig_params=True,
            sync_module_states=on_gpu,  # PyTorch refuses it for CPU tensors; transform synced already
            param_init_fn=delayed_initer.get_param_init_fn() if delayed_initer else None,
        )
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    return model


def batch(step: int, vocab: int) -> torch.Tensor:
    """This data-parallel replica's rows of step ``step``'s batch (TP ranks share rows)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (4, 16), generator=g)
    per = ids.shape[0] // tsm.rdp_size()
    return ids[tsm.rdp_rank() * per:(tsm.rdp_rank() + 1) * per]


def save(path: Path, model, optimizer, step: int) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "checkpoint"))
    if dist.get_rank() == 0:
        (path / "checkpoint" / "step.json").write_text(json.dumps({"step": step}))
    dist.barrier()


def resume(path: Path, model, optimizer) -> int:
    """Load the checkpoint if there is one; return the step to start from."""
    marker = path / "checkpoint" / "step.json"
    if not marker.is_file():
        return 0
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "checkpoint"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads(marker.read_text())["step"]


def export(path: Path, model_dir: str) -> None:
    """Write a Hugging Face directory from the DCP checkpoint: rank 0 alone reads every shard
    into a plain model (DCP keys are the model's own names at global shapes)."""
    if dist.get_rank() == 0:
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        state = {"model": hf.state_dict()}
        dcp.load(state, checkpoint_id=str(path / "checkpoint"), no_dist=True)
        hf.load_state_dict(state["model"], strict=True)
        hf.save_pretrained(path / "export")
    dist.barrier()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stop-after", type=int, default=None, help="stop (after a checkpoint) at this step")
    args = p.parse_args(argv)
    out = Path(args.out)
    tsm.init({"tensor_parallel_degree": args.tp})
    model_dir = str(out / "pretrained")
    if dist.get_rank() == 0 and not (out / "pretrained" / "config.json").is_file():
        make_pretrained(out / "pretrained")
    dist.barrier()
    model = build(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = resume(out, model, optimizer)
    if start and dist.get_rank() == 0:
        print(f"resumed from step {start}")
    losses = {}
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    for step in range(start, args.steps):
        ids = batch(step, vocab)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=tsm.get_rdp_process_group())
        losses[step + 1] = mean.item() / tsm.rdp_size()
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {losses[step + 1]:.4f}")
        if args.stop_after is not None and step + 1 == args.stop_after:
            save(out, model, optimizer, step + 1)
            return {"losses": losses, "stopped": step + 1}
    save(out, model, optimizer, args.steps)
    export(out, model_dir)
    if dist.get_rank() == 0:
        print(f"exported to {out / 'export'}")
    return {"losses": losses}


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
