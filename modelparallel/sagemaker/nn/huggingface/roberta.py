"""RoBERTa state-dict translation under SageMaker's path
(``smdistributed.modelparallel.torch.nn.huggingface.roberta``); the key table is ``models/roberta.py``'s."""

from ....models.roberta import TABLE
from .translate import sagemaker_functions

translate_state_dict_to_hf_roberta, translate_hf_state_dict_to_smdistributed_roberta = sagemaker_functions(
    TABLE, module=__name__, name="roberta")


translate_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_roberta
"""SageMaker's shorter name for the HF -> distributed translation."""
