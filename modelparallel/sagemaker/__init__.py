"""Running SageMaker's scripts unchanged: its module names (``hook``), its environment
variables (``env``) and the ``modelparallel run`` launcher (``launch``)."""

from .hook import sagemaker_imports

__all__ = ["sagemaker_imports"]
