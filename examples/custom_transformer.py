"""SageMaker's two ways to a tensor-parallel custom model: ``smp.nn`` modules used directly, and a
user's layer class registered with a distributed module (``@smp.tp_register`` with hooks).

Run: torchrun --nproc-per-node 2 examples/custom_transformer.py
"""

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

import modelparallel as smp

CONFIG = dict(num_attention_heads=4, attention_head_size=16, hidden_size=64, intermediate_size=256,
              attention_dropout_prob=0.0, hidden_dropout_prob=0.0, causal_mask_size=32)


class DirectModel(nn.Module):
    """The distributed modules in the model definition."""

    def __init__(self, vocab: int = 97):
        super().__init__()
        self.embedding = nn.Embedding(vocab, 64)
        self.encoder = smp.nn.DistributedTransformer(num_layers=2, **CONFIG)
        self.pooler = nn.Linear(64, 64)

    def forward(self, ids):
        h, _ = self.encoder((self.embedding(ids), None))
        return self.pooler(h)


def init_hook(config):
    return (), config


def forward_hook(hidden_states):
    return ((hidden_states, None),), {}


@smp.tp_register(smp.nn.DistributedTransformerLayer, init_hook=init_hook, forward_hook=forward_hook,
                 return_hook=lambda out: out[0])
class MyLayer(nn.Module):
    """A user's post-layer-norm causal transformer layer with the reference layout and names."""

    def __init__(self, config):
        super().__init__()
        h, self.heads, self.size = config["hidden_size"], config["num_attention_heads"], config["attention_head_size"]
        self.attention = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention, name, nn.Linear(h, self.heads * self.size))
        self.attention.dense = nn.Linear(self.heads * self.size, h)
        self.attention.layernorm = nn.LayerNorm(h, eps=1e-5)
        self.output = nn.Module()
        self.output.dense1 = nn.Linear(h, config["intermediate_size"])
        self.output.dense2 = nn.Linear(config["intermediate_size"], h)
        self.output.layernorm = nn.LayerNorm(h, eps=1e-5)

    def forward(self, hidden_states):
        a, (n, s, _) = self.attention, hidden_states.shape
        split = lambda t: t.view(n, s, self.heads, self.size).transpose(1, 2)
        q, k, v = split(a.query(hidden_states)), split(a.key(hidden_states)), split(a.value(hidden_states))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.size)
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), -10000.0)
        ctx = (F.softmax(scores, -1) @ v).transpose(1, 2).reshape(n, s, -1)
        x = a.layernorm(a.dense(ctx) + hidden_states)
        o = self.output
        return o.layernorm(o.dense2(F.gelu(o.dense1(x))) + x)


class RegisteredModel(nn.Module):
    def __init__(self, vocab: int = 97):
        super().__init__()
        self.embedding = nn.Embedding(vocab, 64)
        with smp.tensor_parallelism():
            self.layers = nn.ModuleList(MyLayer(CONFIG) for _ in range(2))
        self.head = nn.Linear(64, vocab)

    def forward(self, ids):
        h = self.embedding(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def main():
    smp.init({"tensor_parallel_degree": 2})
    ids = torch.randint(0, 97, (2, 16))
    for cls in (DirectModel, RegisteredModel):
        reference = cls()
        model = smp.DistributedModel(copy.deepcopy(reference))
        diff = (model(ids) - reference(ids)).abs().max().item()
        kinds = sorted({type(m).__name__ for m in model.distributed_modules()})
        if smp.rank() == 0:
            print(f"{cls.__name__}: distributed {kinds}; max |distributed - single process| = {diff:.2e}")


if __name__ == "__main__":
    main()
