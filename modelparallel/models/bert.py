"""BERT (``BertModel``, ``BertForMaskedLM``, ``BertLMHeadModel``, ``BertForSequenceClassification``...).

Self-attention q, k and v are three ``nn.Linear`` sharded column-wise (each rank holds whole
heads), ``attention.output.dense`` row-wise; the feed-forward likewise. Word embeddings are
vocab-parallel, and the MLM decoder, tied to them, keeps its logits vocab-sharded for the loss:
masked-LM, except ``BertLMHeadModel``'s next-token loss. Position and token-type embeddings,
LayerNorms, the pooler and classifiers stay replicated. No weight is fused.

No attention attribute is rewritten per rank: HF 5.x ``BertSelfAttention`` reshapes with ``-1``
heads and ``attention_head_size`` (per head, the same on every rank); ``num_attention_heads`` and
``all_head_size`` are only read in ``__init__``, so they keep the global values, like the
``out_features`` of the sharded linears. The config check makes every rank hold whole heads.

HF ties the MLM decoder's bias to the head's ``bias`` (``cls.predictions.bias``), which the head
only holds (its forward uses the decoder's), so that holder follows the decoder's vocabulary
sharding. The distributed state dict is HF's; older checkpoints stored
``embeddings.position_ids``, dropped on import (the model recomputes it) and re-created on export
when asked for. ``encoder_arch`` builds any BERT-family encoder (RoBERTa's too) from its prefix
and head names.
"""

import torch

from ..context.spec import ContextSpec
from ._translate import KeyTable
from ..pipeline.split import PipelineSplit
from ..tp.plan import ArchSpec, ModulePlan, SharedInput
from ._architecture import Architecture
from ._parts import column_row

ENCODER = ModulePlan(
    rules={
        "embeddings.word_embeddings": "vocab_embedding",
        **column_row("encoder.layer.*.attention", ("self.query", "self.key", "self.value"), "output.dense"),
        **column_row("encoder.layer.*", ("intermediate.dense",), "output.dense"),
    },
    shared_inputs={"encoder.layer.*.attention.self": SharedInput(arg="hidden_states")},  # q, k, v
)
"""The BERT-family base model (also RoBERTa's: same module tree)."""

ENCODER_PIPELINE = PipelineSplit(blocks="encoder.layer", first=("embeddings",), last=("pooler",))
"""Embeddings on the first stage; the pooler (and the heads) on the last."""

_LAYER = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
          "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
ENCODER_KEYS = (
    "embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias",
    "pooler.dense.weight", "pooler.dense.bias",
    *(f"encoder.layer.{{}}.{m}.{p}" for m in _LAYER for p in ("weight", "bias")),
)


def position_ids(max_seq_len: int, layer: int, config=None) -> torch.Tensor:
    """The [1, n] position ids older checkpoints stored."""
    return torch.arange(max_seq_len).unsqueeze(0)


ENCODER_HEADS = ("ForMaskedLM", "ForTokenClassification")
"""The heads context parallelism runs: per-token outputs (the base model's pooler, classification and
question-answering heads need the whole sequence on one rank)."""


def encoder_context(family: str, positions=None) -> ContextSpec:
    """A BERT-family encoder's ``ContextSpec``: the self-attention modules (HF's attention
    interface; bidirectional unless the config makes a decoder), the heads of ``ENCODER_HEADS``."""
    return ContextSpec(attention="encoder.layer.*.attention.self", positions=positions,
                       heads=tuple(family + h for h in ENCODER_HEADS))


def encoder_arch(model_type: str, prefix: str, mlm: str, head_keys: tuple[str, ...],
                 causal_head: str) -> tuple[ArchSpec, KeyTable]:
    """The plan and key table of a BERT-family encoder: BERT's module tree under ``prefix``.

    Args:
        model_type: the HF ``config.model_type``.
        prefix: the base model's attribute in head models (``bert``).
        mlm: the MLM head's path; its ``decoder`` is tied to the word embeddings and its ``bias``
            only holds the decoder's.
        head_keys: the other keys of the heads (MLM transform, classifiers).
        causal_head: the head class whose LM loss is next-token prediction, not masked.

    Returns:
        (ArchSpec, KeyTable).
    """
    spec = ArchSpec(
        model_type=model_type,
        base=ENCODER,
        head=ModulePlan(rules={f"{mlm}.decoder": "vocab_colwise"}, optional_rules=(f"{mlm}.decoder",),
                        tied_holders=(f"{mlm}.bias",)),
        divisible_config=("num_attention_heads",),
        loss="masked",
        head_losses={causal_head: "causal"},
    )
    table = KeyTable(
        arch=model_type,
        base_prefix=prefix,
        base_keys=ENCODER_KEYS,
        head_keys=(f"{mlm}.bias", f"{mlm}.decoder.weight", f"{mlm}.decoder.bias", *head_keys),
        tied={f"{mlm}.decoder.weight": f"{prefix}.embeddings.word_embeddings.weight",
              f"{mlm}.decoder.bias": f"{mlm}.bias"},
        legacy_buffers={"embeddings.position_ids": position_ids},
    )
    return spec, table


SPEC, TABLE = encoder_arch(
    "bert", "bert", "cls.predictions",
    head_keys=("cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
               "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
               "classifier.weight", "classifier.bias"),
    causal_head="BertLMHeadModel",
)
PIPELINE = ENCODER_PIPELINE
CONTEXT = encoder_context("Bert")  # HF's forward counts positions 0..S-1

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, context=CONTEXT)
