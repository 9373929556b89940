"""RoBERTa (``RobertaModel``, ``RobertaForMaskedLM``, ``RobertaForCausalLM``,
``RobertaForSequenceClassification``...): BERT's encoder under ``roberta``, with its own heads.

The encoder is BERT's module tree, so plan and keys come from ``bert.encoder_arch`` (see
``models/bert.py`` for why no attribute is rewritten per rank). The MLM head is ``lm_head``: its
decoder is vocab-parallel and tied to the word embeddings; ``lm_head.bias`` only holds the
decoder's tied bias. The classification head (``classifier.dense``, ``classifier.out_proj``) stays
replicated.
"""

from .bert import ENCODER_PIPELINE, encoder_arch
from ._architecture import Architecture

SPEC, TABLE = encoder_arch(
    "roberta", "roberta", "lm_head",
    head_keys=("lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight", "lm_head.layer_norm.bias",
               "classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
               "classifier.out_proj.bias"),
    causal_head="RobertaForCausalLM",
)
PIPELINE = ENCODER_PIPELINE

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE)
