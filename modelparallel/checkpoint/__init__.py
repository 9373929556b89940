"""Distributed checkpoints: partial (DCP, reshardable) and full (Hugging Face) with crash safety.

``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` are SageMaker's API; the guarantees
(atomic commit, checksums, failure on one rank raising on all) are documented in ``commit`` and
``errors``.
"""

from .api import (checkpoint_staging_bytes, last_load_report, resume_from_checkpoint, save_checkpoint,
                  wait_for_checkpoints)
from .load.journal import JournalError
from .load.parts import LoadReport
from .safety.errors import CheckpointError
from .safety.safe_load import UnsafeCheckpointError
from .sagemaker.legacy import load, save

__all__ = ["CheckpointError", "JournalError", "LoadReport", "checkpoint_staging_bytes", "last_load_report", "load",
           "resume_from_checkpoint", "save", "save_checkpoint", "UnsafeCheckpointError", "wait_for_checkpoints"]
