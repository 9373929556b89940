"""The call shape of SageMaker's public v1 example scripts, tiny: ``train_gpt_simple.py`` (GPT-2)
and ``train_gptj_smp_tensor_parallel_script.py`` (GPT-J, ``--model_type gptj``), with their
helper modules' calls (``create_pretraining_dataloader``, ``get_param_shapes`` /
``get_buffer_names``). Their imports, argparse defaults read from SageMaker's environment,
``smp.init`` dict, ``PreTrainedModel.init_weights = lambda x: None``, ``smp.model_creation``
options, per-TP-rank seeds, ``torch.cuda.set_device``, the distributed transformer's
``seq_layers`` tree, weight-decay groups, activation checkpointing, dynamic loss scaling,
``@smp.step`` loop and partial / full checkpoints are the scripts' own lines; what differs is
the data (token rows in JSON-lines files), the learning-rate scheduler (their helper
``AnnealingLR`` is a torch ``LambdaLR`` here), and the checkpoint's user content holds plain
data where the scripts store objects (``model_config.to_dict()``, ``int(num_params)``, shapes as
lists: the objects themselves need a user-content allow-list).

Run it as a SageMaker user would: ``modelparallel run --nproc-per-node 2 tests/v1_script_shape.py
--tensor_parallel_degree 2 ...``; the tests also call ``main(argv)`` on harness ranks inside
``sagemaker_imports()``. Rank 0 writes the losses to ``$SM_OUTPUT_DATA_DIR/losses_<start>.json``.
"""

import argparse
import json
import os

import numpy as np
import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp
import torch
import torch.utils.data
from smdistributed.modelparallel.torch.nn import FusedLayerNorm as LayerNorm
from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2  # noqa: F401
from smdistributed.modelparallel.torch.nn.huggingface.gptj import translate_state_dict_to_hf_gptj  # noqa: F401
from transformers import AutoModelForCausalLM, GPT2Config, GPTJConfig, set_seed


class TokenRows(torch.utils.data.Dataset):
    """The data pipeline's GPT dataset: one JSON object per line, ``input_ids`` and ``attention_mask``."""

    def __init__(self, paths):
        self.rows = [line for p in paths for line in open(p)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        obj = json.loads(self.rows[i])
        return torch.tensor(obj["input_ids"]), torch.tensor(obj["attention_mask"])


class DummyDataset(torch.utils.data.dataset.Dataset):
    """What the scripts give pipeline stages after the first: empty tensors, as many as the first
    stage's batches."""

    def __init__(self, length):
        self.batch = (torch.Tensor(0), torch.Tensor(0))
        self.length = length

    def __getitem__(self, index):
        return self.batch

    def __len__(self):
        return self.length


def create_pretraining_dataloader(paths, batch_size, seed, dp_rank, dp_size, shuffle):
    if smp.pp_rank() == 0:
        data = TokenRows(paths)
        sampler = torch.utils.data.DistributedSampler(data, shuffle=shuffle, seed=seed, rank=dp_rank,
                                                      num_replicas=dp_size, drop_last=True)
        dataloader = torch.utils.data.DataLoader(data, sampler=sampler, batch_size=batch_size, drop_last=True)
        smp.broadcast(len(dataloader), smp.PP_GROUP)
    else:
        data_len = smp.recv_from(0, smp.RankType.PP_RANK)
        dataset = DummyDataset(data_len * batch_size)
        dataloader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, drop_last=True)
    return dataloader


def get_param_groups_by_weight_decay(module):
    """The scripts' two groups: layer norms (found as ``smp.nn.FusedLayerNorm`` instances) and
    biases without weight decay, everything else with it; each parameter once."""
    decay, no_decay, seen = [], [], set()
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if isinstance(mod, LayerNorm) or name == "bias" else decay).append(p)
    return {"params": decay}, {"params": no_decay, "weight_decay": 0.0}


def get_param_shapes(model, optimizer):
    """The checkpoint helper's call shape: ``optimizer.fp16_groups`` named through ``model.module``."""
    param_names = {param: name for name, param in model.module.named_parameters()}
    return [{param_names[p]: (p.ds_shape if hasattr(p, "ds_shape") else p.shape) for p in group}
            for group in optimizer.fp16_groups]


def get_buffer_names(model):
    return [n for n, _ in model.module.named_buffers()]


@smp.step
def train_step(model, optimizer, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_type", default="gpt2", choices=["gpt2", "gptj"])
    parser.add_argument("--train_batch_size", type=int, default=4)
    parser.add_argument("--max_steps", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--same_seed", type=int, default=0)
    parser.add_argument("--n_gpus", type=str, default=os.environ["SM_NUM_GPUS"])
    parser.add_argument("--fp16", default=0, type=int)
    parser.add_argument("--bf16", default=0, type=int)
    parser.add_argument("--sharded_data_parallel_degree", default=1, type=int)
    parser.add_argument("--grad_clip", default=1.0, type=float)
    parser.add_argument("--weight_decay", default=0.01, type=float)
    parser.add_argument("--activation_checkpointing", type=int, default=1)
    parser.add_argument("--checkpoint_sublayers", type=int, default=0)
    parser.add_argument("--output-data-dir", type=str, default=os.environ["SM_OUTPUT_DATA_DIR"])
    parser.add_argument("--checkpoint-dir", type=str, default="/opt/ml/checkpoints")
    parser.add_argument("--model-dir", type=str, default=os.environ["SM_MODEL_DIR"])
    parser.add_argument("--training-dir", type=str, default=os.environ["SM_CHANNEL_TRAIN"])
    parser.add_argument("--test-dir", type=str, default=os.environ["SM_CHANNEL_TEST"])
    parser.add_argument("--save_final_full_model", type=int, default=0)
    parser.add_argument("--load_partial", type=int, default=0)
    parser.add_argument("--load_full", type=int, default=0)
    parser.add_argument("--prescaled_batch", type=int, default=1)
    parser.add_argument("--pipeline_parallel_degree", type=int, default=1)
    parser.add_argument("--max_context_width", type=int, default=1024)
    parser.add_argument("--vocab_size", type=int, default=50264)
    parser.add_argument("--hidden_width", type=int, default=768)
    parser.add_argument("--num_layers", type=int, default=12)
    parser.add_argument("--num_heads", type=int, default=12)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--use_distributed_transformer", type=int, default=1)
    parser.add_argument("--tensor_parallel_degree", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--query_key_layer_scaling", type=int, default=1)
    parser.add_argument("--fused_softmax", type=int, default=1)
    parser.add_argument("--fused_bias_gelu", type=int, default=1)
    parser.add_argument("--gradient_accumulation", type=int, default=1)
    parser.add_argument("--num_kept_checkpoints", type=int, default=5)
    parser.add_argument("--checkpoint_freq", type=int, default=10000)
    parser.add_argument("--lr", type=float, default=None)
    args, _ = parser.parse_known_args(argv)
    return args


def compute_num_params(model):
    num_params, seen = 0, set()
    for p in model.parameters():
        if p not in seen:
            seen.add(p)
            num_params += np.prod(p.ds_shape) if hasattr(p, "ds_shape") else np.prod(p.size())
    return num_params


def build_model(args):
    config_class = GPT2Config if args.model_type == "gpt2" else GPTJConfig
    extra = {"rotary_dim": args.hidden_width // args.num_heads // 2} if args.model_type == "gptj" else {}
    model_config = config_class(
        vocab_size=args.vocab_size, n_positions=args.max_context_width, n_embd=args.hidden_width,
        n_layer=args.num_layers, n_head=args.num_heads, n_inner=None, activation_function="gelu_new",
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout, layer_norm_epsilon=1e-05,
        initializer_range=0.02, use_cache=False, bos_token_id=0, eos_token_id=0, return_dict=True, **extra)
    if args.use_distributed_transformer > 0:
        from transformers.modeling_utils import PreTrainedModel

        PreTrainedModel.init_weights = lambda x: None
    set_seed(args.seed)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.get_default_dtype()
    with smp.model_creation(
        tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
        dtype=dtype,
        attention_in_fp32=False,
        query_key_layer_scaling=args.query_key_layer_scaling > 0 and args.bf16 < 1,
        fused_softmax=args.fused_softmax > 0,
        fused_dropout=False,
        fused_bias_gelu=args.fused_bias_gelu > 0,
    ):
        model = AutoModelForCausalLM.from_config(model_config)
    return model, model_config


def main(argv=None):
    args = parse_args(argv)
    smp_config = {
        "ddp": True, "tensor_parallel_degree": args.tensor_parallel_degree,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "microbatches": args.microbatches, "shard_optimizer_state": False, "prescaled_batch": args.prescaled_batch > 0,
        "fp16": args.fp16 > 0, "bf16": args.bf16 > 0, "offload_activations": False,
        "delayed_parameter_initialization": False, "optimize": "speed", "placement_strategy": "cluster",
        "activation_loading_horizon": 4, "skip_tracing": False, "auto_partition": True, "default_partition": 0,
        "static_mode": False, "fast_mode": False, "sharded_data_parallel_degree": args.sharded_data_parallel_degree,
    }
    smp.init(smp_config)
    assert smdistributed.modelparallel.__version__
    model, model_config = build_model(args)
    num_params = compute_num_params(model)

    torch.cuda.set_device(smp.local_rank())
    if not args.same_seed:
        set_seed(args.seed + smp.tp_rank())  # the scripts' own per-TP-rank seed
    model = smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=args.gradient_accumulation)
    m = model.get_module()
    if args.model_type == "gptj":
        transformer_layers = model.module.module.transformer.seq_layers
    else:
        transformer_layers = m.transformer.seq_layers

    param_groups = get_param_groups_by_weight_decay(m)
    optimizer = torch.optim.Adam(param_groups, betas=(0.9, 0.95), lr=args.lr, weight_decay=args.weight_decay)
    if args.activation_checkpointing:
        if args.checkpoint_sublayers:
            for c in transformer_layers.children():
                smp.set_activation_checkpointing(c.attention)
                smp.set_activation_checkpointing(c.output)
        else:
            smp.set_activation_checkpointing(transformer_layers, strategy="each")
    optimizer = smp.DistributedOptimizer(optimizer, static_loss_scale=None, dynamic_loss_scale=True,
                                         dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))

    total_steps, start_batch_index = 0, 0
    if args.load_full or args.load_partial:
        partial = not args.load_full
        path = args.checkpoint_dir if partial else args.model_dir
        tag = None if partial else "fullmodel.pt"
        user_content = smp.resume_from_checkpoint(path, tag=tag, partial=partial)
        total_steps = user_content["total_steps"] if partial else 0
        start_batch_index = user_content.get("start_batch_index", 0)
        if "lr_scheduler" in user_content:
            lr_scheduler.load_state_dict(user_content["lr_scheduler"])
    start = total_steps

    dp_rank = smp.dp_rank() if not args.prescaled_batch else smp.rdp_rank()
    dp_size = smp.dp_size() if not args.prescaled_batch else smp.rdp_size()
    paths = sorted(os.path.join(args.training_dir, p) for p in os.listdir(args.training_dir) if p.endswith(".json"))
    loader = create_pretraining_dataloader(paths, args.train_batch_size, args.seed, dp_rank, dp_size,
                                           shuffle=args.same_seed < 1)
    set_seed(args.seed)
    model.train()
    losses = []
    for batch_idx, (input_ids, attention_mask) in enumerate(loader):
        if batch_idx < start_batch_index:
            continue
        if total_steps >= args.max_steps:
            break
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, optimizer, input_ids, attention_mask, args).reduce_mean()
        if args.fp16:
            optimizer.clip_master_grads(args.grad_clip)
        optimizer.step()
        if not (args.fp16 and optimizer.overflow):
            lr_scheduler.step()
        total_steps += 1
        losses.append(loss.item())
        if smp.rank() == 0:
            print(f"Batch {total_steps - 1} Loss: {loss.item()}")
        if not (total_steps % args.checkpoint_freq):
            user_content = {"cli_args": args.__dict__, "num_params": int(num_params), "total_steps": total_steps,
                            "model_config": model_config.to_dict(), "start_batch_index": batch_idx + 1,
                            "buffer_names": get_buffer_names(model),
                            "param_shapes": [{k: list(v) for k, v in g.items()} for g in get_param_shapes(model, optimizer)],
                            "lr_scheduler": lr_scheduler.state_dict()}
            smp.save_checkpoint(args.checkpoint_dir, tag=f"total_steps{total_steps}", partial=True, model=model,
                                optimizer=optimizer, user_content=user_content,
                                num_kept_partial_checkpoints=args.num_kept_checkpoints)
    if args.save_final_full_model:
        smp.save_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False, model=model,
                            user_content={"total_steps": total_steps, "model_config": model_config.to_dict()})
    smp.barrier()
    if smp.rank() == 0:
        with open(os.path.join(args.output_data_dir, f"losses_{start}.json"), "w") as f:
            json.dump(losses, f)
        print("SMP training finished successfully")
    return losses


if __name__ == "__main__":
    main()
