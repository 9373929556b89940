"""Bringing a model from the meta device, rank 0 or safetensors files to real, sharded tensors.

Meta-device helpers, Hugging Face's per-module initialization, shard-on-read loading, block reads
from safetensors files, full and local state dicts, and the steps ``DistributedModel`` runs around
the tensor-parallel walker. The public API modules (``model``, ``transform``, ``delayed_param``,
``creation``) sit on top of this package.
"""
