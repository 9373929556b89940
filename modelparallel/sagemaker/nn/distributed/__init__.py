"""SageMaker's distributed modules (``smp.nn.Distributed*``): plain modules with the reference
layout and parameter names, each carrying the tensor-parallel plan ``DistributedModel`` applies."""

from .attention import DistributedAttentionLayer
from .base import DistributedEmbedding, DistributedLinear, DistributedModule, FusedLayerNorm
from .layers import DistributedTransformer, DistributedTransformerLayer, DistributedTransformerOutputLayer
from .lm_head import DistributedTransformerLMHead

__all__ = [
    "DistributedAttentionLayer", "DistributedEmbedding", "DistributedLinear", "DistributedModule",
    "DistributedTransformer", "DistributedTransformerLMHead", "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer", "FusedLayerNorm",
]
