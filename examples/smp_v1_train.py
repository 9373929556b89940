"""A SageMaker model parallelism v1 training script, unchanged but for its import line.

Everything below is written as for ``smdistributed.modelparallel.torch``: ``smp.init`` with
SageMaker's keys, data sharded with ``dp_rank()``/``dp_size()`` (``prescaled_batch`` false, the
default: each tensor-parallel rank reads its own batch and the TP group computes on their union),
an ``@smp.step`` function running ``microbatches`` microbatches, ``model.backward``, dynamic loss
scaling, activation checkpointing, partial checkpoints and resuming. It trains a small GPT-2
built from its config on a synthetic next-token task (each sequence counts up from a random
start), so it needs no download; the loss falls from about log(vocab) towards 0.

    torchrun --nproc-per-node 2 examples/smp_v1_train.py --out runs/v1 --steps 8 --stop-after 4
    torchrun --nproc-per-node 2 examples/smp_v1_train.py --out runs/v1 --steps 8   # resumes at 4
    torchrun --nproc-per-node 4 examples/smp_v1_train.py --out runs/v1x4 --steps 8  # TP=2 x RDP=2
"""

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import modelparallel as smp  # was: import smdistributed.modelparallel.torch as smp

VOCAB, SEQ = 64, 16


def dataset(n: int = 256) -> TensorDataset:
    """Sequences that count up (mod VOCAB) from a random start: next token = this token + 1."""
    start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset((start + torch.arange(SEQ)) % VOCAB)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--stop-after", type=int, default=0, help="exit after this step (to try resuming)")
    ap.add_argument("--batch-size", type=int, default=4, help="per rank (per dp rank)")
    ap.add_argument("--microbatches", type=int, default=2)
    return ap.parse_args(argv)


def main(argv=None) -> list[float]:
    """Train; returns this rank's loss per step run."""
    args = parse_args(argv)
    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 1, "microbatches": args.microbatches,
              "ddp": True, "optimize": "speed", "placement_strategy": "cluster", "random_seed": 7})
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1):
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ))
    model = smp.DistributedModel(model, trace_device="gpu")
    for block in model.get_module().transformer.h:
        smp.set_activation_checkpointing(block)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                         static_loss_scale=None, dynamic_loss_scale=True,
                                         dynamic_loss_args={"scale_window": 1000, "min_scale": 1})
    start = 0
    if (Path(args.out) / "newest").exists():
        start = smp.resume_from_checkpoint(args.out, partial=True)["step"]

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=smp.dp_size(), rank=smp.dp_rank(), shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    @smp.step
    def train_step(model, ids):
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        return loss

    step, losses = start, []
    while step < args.steps:
        sampler.set_epoch(step)
        for (ids,) in loader:
            step += 1
            loss = train_step(model, ids).reduce_mean()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if smp.rank() == 0:
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
            if step == args.stop_after or step == args.steps:
                smp.save_checkpoint(args.out, tag=f"step{step}", partial=True, model=model, optimizer=optimizer,
                                    user_content={"step": step})
                return losses
    return losses


if __name__ == "__main__":
    main()
