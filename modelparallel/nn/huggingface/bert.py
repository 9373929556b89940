"""BERT state-dict translation. The distributed format is HF's. Older checkpoints stored
``embeddings.position_ids``; it is dropped on import (the model recomputes it) and re-created on
export when ``max_seq_len`` is given."""

import torch

from .translate import KeyTable, from_hf, to_hf

_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
            "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")


def encoder_table(arch: str, base_prefix: str, head_keys: tuple[str, ...], tied: dict[str, str]) -> KeyTable:
    """The key table shared by BERT-like encoders (BERT, RoBERTa); heads differ."""
    return KeyTable(
        arch=arch,
        base_prefix=base_prefix,
        base_keys=(
            "embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
            "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias",
            "pooler.dense.weight", "pooler.dense.bias",
            *(f"encoder.layer.{{}}.{m}.{p}" for m in _LINEARS for p in ("weight", "bias")),
        ),
        head_keys=head_keys,
        tied=tied,
        legacy_buffers={"embeddings.position_ids": lambda n, layer: torch.arange(n).unsqueeze(0)},
    )


TABLE = encoder_table(
    "bert", "bert",
    head_keys=("cls.predictions.bias", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
               "cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
               "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
               "classifier.weight", "classifier.bias"),
    tied={"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
          "cls.predictions.decoder.bias": "cls.predictions.bias"},
)


def translate_state_dict_to_hf_bert(state_dict, max_seq_len=None, legacy_buffers=False):
    """Distributed-format BERT state dict -> HF BERT state dict."""
    return to_hf(TABLE, state_dict, max_seq_len, legacy_buffers)


def translate_hf_state_dict_to_smdistributed_bert(state_dict):
    """HF BERT state dict -> distributed format."""
    return from_hf(TABLE, state_dict)
