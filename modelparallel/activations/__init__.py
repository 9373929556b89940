"""Activation memory: checkpointing (recompute in backward) and offloading (keep on the host)."""

from .checkpointing import (STRATEGIES, is_activation_checkpointed, job_offloader, run_checkpointed, run_sequential,
                            segments, set_activation_checkpointing)
from .offload import ActivationOffloader, offloader_for

__all__ = ["STRATEGIES", "ActivationOffloader", "is_activation_checkpointed", "job_offloader", "offloader_for",
           "run_checkpointed", "run_sequential", "segments", "set_activation_checkpointing"]
