"""SageMaker's ``smp.patches`` namespace: drop-in calls used inside model code."""

from . import checkpoint

__all__ = ["checkpoint"]
