"""SageMaker v2's ``torch.sagemaker.distributed`` module paths (``checkpoint``)."""
