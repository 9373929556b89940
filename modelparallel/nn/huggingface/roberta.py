"""RoBERTa state-dict translation: BERT's encoder keys under ``roberta``, RoBERTa's own heads."""

from .bert import encoder_table
from .translate import from_hf, to_hf

TABLE = encoder_table(
    "roberta", "roberta",
    head_keys=("lm_head.bias", "lm_head.decoder.weight", "lm_head.decoder.bias", "lm_head.dense.weight",
               "lm_head.dense.bias", "lm_head.layer_norm.weight", "lm_head.layer_norm.bias",
               "classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
               "classifier.out_proj.bias"),
    tied={"lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
          "lm_head.decoder.bias": "lm_head.bias"},
)


def translate_state_dict_to_hf_roberta(state_dict, max_seq_len=None, legacy_buffers=False):
    """Distributed-format RoBERTa state dict -> HF RoBERTa state dict."""
    return to_hf(TABLE, state_dict, max_seq_len, legacy_buffers)


def translate_hf_state_dict_to_smdistributed_roberta(state_dict):
    """HF RoBERTa state dict -> distributed format."""
    return from_hf(TABLE, state_dict)


translate_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_roberta
