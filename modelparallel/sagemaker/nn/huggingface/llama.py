"""Llama state-dict translation under SageMaker's path
(``smdistributed.modelparallel.torch.nn.huggingface.llama``); the key table is ``models/llama.py``'s."""

from ....models.llama import TABLE
from .translate import sagemaker_functions

translate_state_dict_to_hf_llama, translate_hf_state_dict_to_smdistributed_llama = sagemaker_functions(
    TABLE, module=__name__, name="llama")
