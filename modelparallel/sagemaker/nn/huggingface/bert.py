"""BERT state-dict translation under SageMaker's path
(``smdistributed.modelparallel.torch.nn.huggingface.bert``); the key table is ``models/bert.py``'s."""

from ....models.bert import TABLE
from .translate import sagemaker_functions

translate_state_dict_to_hf_bert, translate_hf_state_dict_to_smdistributed_bert = sagemaker_functions(
    TABLE, module=__name__, name="bert")
