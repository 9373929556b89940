"""A user-written model with no built-in plan, made tensor-parallel with ``tp_register_with_module``.

Run: torchrun --nproc-per-node 2 examples/custom_block.py
"""

import copy

import torch
from torch import nn

import modelparallel as smp


class Block(nn.Module):
    """Pre-norm attention + MLP with a fused q|k|v projection and its own head count."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(nn.functional.gelu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 97, dim: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


BLOCK_PLAN = smp.ModulePlan(
    rules={"qkv": "packed_colwise", "proj": "rowwise", "up": "colwise", "down": "rowwise"},
    packed={"qkv": 3},                     # q | k | v fused along the output: shard inside each
    per_rank_attrs={"": ("num_heads",)},   # forward reshapes with num_heads: per-rank value
)


def main():
    smp.init({"tensor_parallel_degree": 2})
    smp.tp_register_with_module(Block, BLOCK_PLAN)
    reference = TinyLM()
    model = smp.DistributedModel(copy.deepcopy(reference))
    ids = torch.randint(0, 97, (2, 16))
    diff = (model(ids) - reference(ids)).abs().max().item()
    if smp.rank() == 0:
        print(f"max |distributed - single process| = {diff:.2e}")


if __name__ == "__main__":
    main()
