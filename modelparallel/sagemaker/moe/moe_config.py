"""SageMaker v2's ``torch.sagemaker.moe.moe_config``: ``MoEConfig``, the mixture-of-experts options
(the options and their checks are the engine's, ``modelparallel/expert/config.py``)."""

from ...expert.config import LOAD_BALANCING, MoEConfig

__all__ = ["LOAD_BALANCING", "MoEConfig"]
