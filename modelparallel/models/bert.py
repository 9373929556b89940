"""BERT (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``...): plan as data.

Self-attention q, k and v are three ``nn.Linear`` sharded column-wise (each rank holds whole
heads), ``attention.output.dense`` row-wise; the feed-forward likewise. Word embeddings are
vocab-parallel, and the MLM decoder, tied to them, keeps its logits vocab-sharded for the loss.
Position and token-type embeddings, LayerNorms, the pooler and classifiers stay replicated.

No attention attribute is rewritten per rank: HF 5.x ``BertSelfAttention`` reshapes with ``-1``
heads and ``attention_head_size`` (per head, the same on every rank); ``num_attention_heads`` and
``all_head_size`` are only read in ``__init__``, so they keep the global values, like the
``out_features`` of the sharded linears. The config check makes every rank hold whole heads.

HF ties ``cls.predictions.decoder.bias`` to ``cls.predictions.bias``, which
``BertLMPredictionHead`` only holds (its forward uses the decoder's), so that holder follows the
decoder's vocabulary sharding.
"""

from ..tp.plan import ArchSpec, ModulePlan, SharedInput

ENCODER = ModulePlan(
    rules={
        "embeddings.word_embeddings": "vocab_embedding",
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    },
    shared_inputs={"encoder.layer.*.attention.self": SharedInput(arg="hidden_states")},  # q, k, v
)
"""The BERT-family base model (also RoBERTa's: same module tree)."""

SPEC = ArchSpec(
    model_type="bert",
    base=ENCODER,
    head=ModulePlan(
        rules={"cls.predictions.decoder": "vocab_colwise"},
        optional_rules=("cls.predictions.decoder",),
        tied_holders=("cls.predictions.bias",),
    ),
    divisible_config=("num_attention_heads",),
)
