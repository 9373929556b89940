"""SageMaker's checkpoint helpers, kept apart from the engine (nothing in ``checkpoint/`` imports
from here): v1's ``smp.save`` / ``smp.load`` of any object (``legacy``, exported by ``import
modelparallel``), and v2's retention helper ``torch.sagemaker.checkpoint.utils`` (``utils``, also
importable as ``modelparallel.checkpoint.utils``, the path SageMaker's name maps to). The
single-file full checkpoint ``fullmodel.pt`` is a format ``save_checkpoint`` itself writes:
``checkpoint/single_file.py``."""
