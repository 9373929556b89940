"""Distributed checkpoints: partial (DCP, reshardable) and full (Hugging Face) with crash safety.

``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` are SageMaker's API; the guarantees
(atomic commit, checksums, failure on one rank raising on all) are documented in ``commit`` and
``errors``. SageMaker v1's ``smp.save`` / ``smp.load`` of any object live in ``sagemaker/legacy.py``
(the compatibility surface); ``import modelparallel`` exports them.
"""

from .api import (checkpoint_staging_bytes, last_load_report, resume_from_checkpoint, save_checkpoint,
                  wait_for_checkpoints)
from .load.journal import JournalError
from .load.parts import LoadReport
from .safety.errors import CheckpointError
from .safety.safe_load import UnsafeCheckpointError

__all__ = ["CheckpointError", "JournalError", "LoadReport", "checkpoint_staging_bytes", "last_load_report",
           "resume_from_checkpoint", "save_checkpoint", "UnsafeCheckpointError", "wait_for_checkpoints"]
