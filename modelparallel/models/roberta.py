"""RoBERTa (``RobertaModel``, ``RobertaForMaskedLM``, ``RobertaForCausalLM``,
``RobertaForSequenceClassification``...): BERT's encoder under ``roberta``, with its own heads.

The encoder is BERT's module tree, so plan and keys come from ``bert.encoder_arch`` (see
``models/bert.py`` for why no attribute is rewritten per rank). The MLM head is ``lm_head``: its
decoder is vocab-parallel and tied to the word embeddings; ``lm_head.bias`` only holds the
decoder's tied bias. The classification head (``classifier.dense``, ``classifier.out_proj``) stays
replicated.
"""

import torch

from .bert import ENCODER_PIPELINE, encoder_arch, encoder_context
from ._architecture import Architecture


def positions(config, input_ids, length):
    """RoBERTa's position ids: counted from ``pad_token_id`` + 1 over non-padding tokens (padding
    keeps ``pad_token_id``), from the whole sequences' ids, as ``RobertaEmbeddings`` counts them."""
    if input_ids is None:
        return torch.arange(config.pad_token_id + 1, length + config.pad_token_id + 1).unsqueeze(0)
    real = input_ids.ne(config.pad_token_id).int()
    return (torch.cumsum(real, dim=1) * real).long() + config.pad_token_id


SPEC, TABLE = encoder_arch(
    "roberta", "roberta", "lm_head",
    head_keys=("lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight", "lm_head.layer_norm.bias",
               "classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
               "classifier.out_proj.bias"),
    causal_head="RobertaForCausalLM",
)
PIPELINE = ENCODER_PIPELINE
CONTEXT = encoder_context("Roberta", positions)

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, context=CONTEXT)
