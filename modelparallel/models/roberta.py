"""RoBERTa (``RobertaModel``, ``RobertaForMaskedLM``, ``RobertaForSequenceClassification``...).

The encoder is BERT's module tree, so it shares BERT's plan (see ``models/bert.py`` for why no
attribute is rewritten per rank). The MLM head is ``lm_head``: its decoder is vocab-parallel and
tied to the word embeddings; ``lm_head.bias`` only holds the decoder's tied bias. The
classification head (``classifier.dense``, ``classifier.out_proj``) stays replicated.
"""

from ..tp.plan import ArchSpec, ModulePlan
from .bert import ENCODER

SPEC = ArchSpec(
    model_type="roberta",
    base=ENCODER,
    head=ModulePlan(
        rules={"lm_head.decoder": "vocab_colwise"},
        optional_rules=("lm_head.decoder",),
        tied_holders=("lm_head.bias",),
    ),
    divisible_config=("num_attention_heads",),
)
