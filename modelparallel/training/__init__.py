"""What runs at every training step of a sharded model: gradient averaging over data-parallel ranks,
FSDP2 composition with TP, the tensor-parallel group's union batch, the global gradient norm, fp32
master weights, loss scaling, and the optimizer state in SageMaker's layout.
"""
