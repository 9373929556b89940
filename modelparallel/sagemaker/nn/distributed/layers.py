"""``smp.nn.DistributedTransformerOutputLayer``, ``DistributedTransformerLayer`` and
``DistributedTransformer``: the MLP block (intermediate features split over the ranks), a layer
(attention, optional cross-attention, MLP) and a stack of layers (``seq_layers.N``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ....tp.plan import ModulePlan
from .attention import DistributedAttentionLayer
from .base import DistributedModule, FusedLayerNorm, InitLinear, check_activation, check_layernorms


class DistributedTransformerOutputLayer(DistributedModule):
    """``dense2(act(dense1(x)))``, dropout, then the residual (``dense1`` column-parallel,
    ``dense2`` row-parallel). Arguments as ``DistributedTransformerLayer``'s;
    ``fp32_residual_addition`` adds the residual in float32 (for fp16/bf16 models)."""

    tp_plan = ModulePlan(rules={"dense1": "colwise", "dense2": "rowwise"})

    def __init__(self, hidden_size: int = 1024, intermediate_size: int = 4096, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
                 fp32_residual_addition: bool = False):
        super().__init__()
        check_layernorms("DistributedTransformerOutputLayer", pre_layernorm, post_layernorm)
        self.activation = check_activation(activation)
        self.fp32_residual_addition = fp32_residual_addition
        std = initializer_range if use_normal_initialization else None
        self.dense1 = InitLinear(hidden_size, intermediate_size, std=std)
        self.dense2 = InitLinear(intermediate_size, hidden_size, std=std)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = FusedLayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.layernorm = FusedLayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        norm = self.pre_layernorm(inp) if self.pre_layernorm is not None else inp
        act = F.gelu if self.activation == "gelu" else F.relu
        out = self.dropout(self.dense2(act(self.dense1(norm))))
        total = (inp.float() + out.float()).to(inp.dtype) if self.fp32_residual_addition else inp + out
        return self.layernorm(total) if self.layernorm is not None else total


_ATTENTION_ARGS = ("num_attention_heads", "attention_head_size", "hidden_size", "attention_dropout_prob",
                   "hidden_dropout_prob", "layernorm_epsilon", "initializer_range", "use_normal_initialization",
                   "causal_mask_size", "pre_layernorm", "post_layernorm")
_OUTPUT_ARGS = ("hidden_size", "intermediate_size", "hidden_dropout_prob", "activation", "layernorm_epsilon",
                "initializer_range", "use_normal_initialization", "pre_layernorm", "post_layernorm",
                "fp32_residual_addition")


class DistributedTransformerLayer(DistributedModule):
    """One transformer layer: ``attention``, then ``cross_attention`` (with
    ``add_cross_attention``), then ``output``.

    Forward takes ``(hidden_states, attention_mask)``, or with ``add_cross_attention``
    ``(hidden_states, cross_states, attention_mask, cross_mask)``, masks additive ``[N, 1, 1, S]``;
    returns the same tuple with ``hidden_states`` replaced by the layer's output. Arguments: see
    ``DistributedAttentionLayer`` and ``DistributedTransformerOutputLayer``.
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, causal_mask_size: int | None = None,
                 add_cross_attention: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
                 fp32_residual_addition: bool = False):
        super().__init__()
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.add_cross_attention = add_cross_attention
        self.attention = DistributedAttentionLayer(**{k: args[k] for k in _ATTENTION_ARGS})
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(cross_attention=True,
                                                             **{k: args[k] for k in _ATTENTION_ARGS})
        self.output = DistributedTransformerOutputLayer(**{k: args[k] for k in _OUTPUT_ARGS})

    def forward(self, inputs):
        if self.add_cross_attention:
            hidden_states, cross_states, attention_mask, cross_mask = inputs
        else:
            hidden_states, attention_mask = inputs
        out = self.attention((hidden_states, attention_mask))
        if self.add_cross_attention:
            out = self.cross_attention((out, cross_states, cross_mask))
        out = self.output(out)
        if self.add_cross_attention:
            return out, cross_states, attention_mask, cross_mask
        return out, attention_mask


class DistributedTransformer(DistributedModule):
    """``num_layers`` ``DistributedTransformerLayer`` s in ``seq_layers`` (an ``nn.Sequential``);
    forward and return as the layer's. Other arguments: see ``DistributedTransformerLayer``."""

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, fp32_residual_addition: bool = False):
        super().__init__()
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__", "num_layers")}
        self.num_layers = num_layers
        self.seq_layers = nn.Sequential(*(DistributedTransformerLayer(**args) for _ in range(num_layers)))

    def forward(self, inputs):
        return self.seq_layers(inputs)
