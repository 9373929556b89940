"""Neural-network modules with SageMaker's paths: the distributed modules (``smp.nn.Distributed*``,
``smp.nn.FusedLayerNorm``) and ``modelparallel.nn.huggingface.*``."""

from .distributed import (
    DistributedAttentionLayer, DistributedEmbedding, DistributedLinear, DistributedModule, DistributedTransformer,
    DistributedTransformerLayer, DistributedTransformerLMHead, DistributedTransformerOutputLayer, FusedLayerNorm,
)

__all__ = [
    "DistributedAttentionLayer", "DistributedEmbedding", "DistributedLinear", "DistributedModule",
    "DistributedTransformer", "DistributedTransformerLMHead", "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer", "FusedLayerNorm",
]
