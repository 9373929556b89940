"""gptneo: tensor-parallel plan (to be written)."""

SPEC = None
