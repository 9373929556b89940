"""Tensor parallelism on DTensor: styles by name, plans as data, one walker, vocab-parallel loss."""
