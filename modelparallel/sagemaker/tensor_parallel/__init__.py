"""SageMaker v2's ``torch.sagemaker.tensor_parallel`` module paths."""
