"""SageMaker v2's ``torch.sagemaker.grad_norm``: ``clip_grad_norm_(model, max_norm)`` by the norm
of the whole model (see ``modelparallel/clip.py``)."""

from ..clip import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
