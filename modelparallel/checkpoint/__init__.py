"""Distributed checkpoints: partial (DCP, reshardable) and full (Hugging Face) with crash safety.

``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` are SageMaker's API; the guarantees
(atomic commit, checksums, failure on one rank raising on all) are documented in ``commit`` and
``errors``. SageMaker v1's ``smp.save`` / ``smp.load`` of any object live in ``sagemaker/legacy.py``
(the compatibility surface); ``import modelparallel`` exports them.

Every name is imported on first use (``EXPORTS`` says from where): the launcher's ``--resume``
check reads checkpoints through ``safety`` (no torch), and importing this package for it must not
import ``api`` (torch, DCP: seconds before every launch).
"""

import importlib as _importlib

_FROM = {
    ".api": "checkpoint_staging_bytes last_load_report resume_from_checkpoint save_checkpoint wait_for_checkpoints",
    ".load.journal": "JournalError",
    ".load.parts": "LoadReport",
    ".safety.failure": "CheckpointError",
    ".safety.safe_load": "UnsafeCheckpointError",
}

EXPORTS: dict[str, str] = {name: module for module, names in _FROM.items() for name in names.split()}
"""Public name -> the module (relative to this package) it is imported from."""

__all__ = ["CheckpointError", "JournalError", "LoadReport", "checkpoint_staging_bytes", "last_load_report",
           "resume_from_checkpoint", "save_checkpoint", "UnsafeCheckpointError", "wait_for_checkpoints"]


def __getattr__(name: str):
    """A public name, imported now and kept in the package."""
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))
