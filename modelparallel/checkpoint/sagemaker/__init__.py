"""SageMaker's checkpoint formats and helpers, kept apart from the engine (which imports nothing
from here): v1's ``smp.save`` / ``smp.load`` (``legacy``), the single-file full checkpoint
``fullmodel.pt`` (``single_file``), and v2's retention helper ``torch.sagemaker.checkpoint.utils``
(``utils``, also importable as ``modelparallel.checkpoint.utils``, the path SageMaker's name maps to)."""
