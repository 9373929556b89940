"""SageMaker v2's ``torch.sagemaker.checkpoint.utils`` (the import hook maps that name here): the
retention helper lives in ``sagemaker.utils``."""

from .sagemaker.utils import SORT_BY_LAST_INT, limit_num_subdirs

__all__ = ["SORT_BY_LAST_INT", "limit_num_subdirs"]
