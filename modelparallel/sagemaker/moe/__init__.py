"""SageMaker v2's ``torch.sagemaker.moe``: the options of its mixture-of-experts implementation."""
