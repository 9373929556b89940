"""SageMaker v2's ``torch.sagemaker.distributed.checkpoint``: sharded and local checkpoints,
saved synchronously or in the background, on PyTorch's distributed checkpoint (DCP) format.

``state_dict_saver`` (``save``, ``async_save``, ``maybe_finalize_async_calls``), ``async_utils``
(``AsyncCallsQueue``), ``state_dict_loader`` (``load``), ``state_dict_utils``
(``sm_state_dict_type``, ``SMStateDictType``, ``init_optim_state``) and ``filesystem``
(``DistributedFileSystemReader`` / ``Writer``), under SageMaker's module paths.
"""
