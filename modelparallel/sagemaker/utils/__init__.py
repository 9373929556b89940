"""SageMaker v2's ``torch.sagemaker.utils`` helpers (``process_group_utils``, ``utils``,
``module_utils``), under the same module paths."""
