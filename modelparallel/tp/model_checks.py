"""Checks of a model against its architecture's plan that read the model's config: what the plan
refuses outright, attention implementations, the vocabulary.

The walker runs them with its other checks, before any tensor is touched; the automatic plan
(tp/auto) applies the same rules to models without a file.
"""

from __future__ import annotations

from torch import nn

from .plan import KNOWN_ATTENTION, ArchSpec, known_attention, to_glob


def refuse_unsupported(model: nn.Module, spec: ArchSpec, tp: int) -> None:
    """Raise ``NotImplementedError`` naming the feature when a configuration the plan refuses
    (``spec.unsupported``) applies at a degree above 1."""
    config = model.config
    for case in spec.unsupported:
        if tp > 1 and case.applies(config):
            raise NotImplementedError(f"{type(model).__name__}: {case.what} is not supported under tensor "
                                      f"parallelism ({case.describe(config)} in its {type(config).__name__})")


def refuse_sequence_parallel(model: nn.Module, spec: ArchSpec | None) -> None:
    """Raise ``NotImplementedError`` when sequence parallelism is asked of a model whose plan is
    not known to run under it (no plan, ``spec.sequence_parallel`` False: an automatic plan not
    verified under it) or of a configuration its plan refuses there (``spec.sequence_unsupported``)."""
    if spec is None or not spec.sequence_parallel:
        why = "which has no tensor-parallel plan" if spec is None else \
            f"whose plan ({spec.model_type!r}) is not known to reproduce it under sequence parallelism"
        raise NotImplementedError(f"sequence_parallel for {type(model).__name__}, {why}, is not implemented")
    config = model.config
    for case in spec.sequence_unsupported:
        if case.applies(config):
            raise NotImplementedError(f"sequence_parallel for {type(model).__name__} with {case.what} is not "
                                      f"implemented ({case.describe(config)} in its {type(config).__name__})")


def attention_problems(model: nn.Module) -> list[str]:
    """An attention implementation not known to compute head by head, naming the attention modules."""
    impl = getattr(model.config, "_attn_implementation", None)
    if known_attention(impl):
        return []
    attn = sorted({to_glob(p) for p, m in model.named_modules() if "Attention" in type(m).__name__})
    return [f"{', '.join(attn) or type(model).__name__}: attention implementation {impl!r} is not one known to "
            f"compute head by head ({', '.join(KNOWN_ATTENTION)}, flash_attention_*)"]


def vocab_problems(model: nn.Module, assignments) -> list[str]:
    """Vocabulary-parallel embeddings whose rows are not the config's vocabulary (the loss and the
    LM head shard that range)."""
    vocab = getattr(model.config, "vocab_size", None)
    return [f"{a.path}: its first dimension ({a.module.num_embeddings}) is not the vocabulary "
            f"({type(model.config).__name__}.vocab_size = {vocab})"
            for a in assignments
            if a.style == "vocab_embedding" and isinstance(vocab, int) and a.module.num_embeddings != vocab]
