"""GPT-Neo state-dict translation under SageMaker's path
(``smdistributed.modelparallel.torch.nn.huggingface.gptneo``); the key table is ``models/gptneo.py``'s."""

from ....models.gptneo import TABLE
from .translate import sagemaker_functions

translate_state_dict_to_hf_gptneo, translate_hf_state_dict_to_smdistributed_gptneo = sagemaker_functions(
    TABLE, module=__name__, name="gptneo", config_arg=True)
