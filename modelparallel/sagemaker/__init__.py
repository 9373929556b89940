"""The SageMaker compatibility surface: everything that exists so SageMaker's scripts run unchanged.

- ``hook``: SageMaker's module names (``smdistributed.modelparallel.torch``, ``torch.sagemaker``)
  resolved to this package; ``env``, ``launch``, ``torch_calls``: the ``modelparallel run`` launcher.
- ``v1`` and ``v2``: the two APIs' root modules; ``v2`` also holds the PyTorch patches only v2
  scripts need (FSDP1's data-parallel layout, its DTensor views and TP state dicts), installed by
  v2's ``init`` and ``transform`` (``v2/contract.py``).
- SageMaker's submodules under their own paths (``nn``, ``tensor_parallel``, ``moe``, ``utils``,
  ``patches``, ``grad_norm``, ``logger``, ``state``, ``cp``): thin names over the engine.

The engine (the rest of the package) never imports from here (tests/test_import_graph.py).
"""

from .hook import sagemaker_imports

__all__ = ["sagemaker_imports"]
