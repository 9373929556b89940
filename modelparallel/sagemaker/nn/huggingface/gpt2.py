"""GPT-2 state-dict translation under SageMaker's path
(``smdistributed.modelparallel.torch.nn.huggingface.gpt2``); the key table is ``models/gpt2.py``'s."""

from ....models.gpt2 import TABLE
from .translate import sagemaker_functions

translate_state_dict_to_hf_gpt2, translate_hf_state_dict_to_smdistributed_gpt2 = sagemaker_functions(
    TABLE, module=__name__, name="gpt2")
