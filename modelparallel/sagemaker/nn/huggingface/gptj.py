"""GPT-J state-dict translation under SageMaker's path
(``smdistributed.modelparallel.torch.nn.huggingface.gptj``); the key table is ``models/gptj.py``'s."""

from ....models.gptj import TABLE
from .translate import sagemaker_functions

translate_state_dict_to_hf_gptj, translate_hf_state_dict_to_smdistributed_gptj = sagemaker_functions(
    TABLE, module=__name__, name="gptj")


translate_hf_gptj_state_dict_to_smdistributed_gptj = translate_hf_state_dict_to_smdistributed_gptj
"""SageMaker's other spelling of the HF -> distributed translation."""


def translate_hf_gptj_state_dict_to_smdistributed(state_dict, max_seq_len=None):
    """SageMaker's two-argument spelling: HF GPT-J -> distributed format. ``max_seq_len`` is
    accepted for the older call and has no effect (no mask buffer is imported)."""
    return translate_hf_state_dict_to_smdistributed_gptj(state_dict)
