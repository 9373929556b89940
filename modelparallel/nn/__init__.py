"""Neural-network helpers with SageMaker's module paths (``modelparallel.nn.huggingface.*``)."""
