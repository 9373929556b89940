"""What ``--model`` names: a small GPT-2 (or Mixtral, for ``--ep``) preset trained from scratch, or a
local HF model directory.

Presets exist so the CLI runs offline on any machine: they need no weights and no vocabulary
file (they use the byte tokenizer). Dropout is off in all of them: short runs on a corpus much
larger than the number of tokens seen do not overfit, and dropout only slows the loss down.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from .corpus import ByteTokenizer

PRESETS: dict[str, dict] = {
    "gpt2-micro": dict(n_embd=64, n_layer=2, n_head=4),     # tests: seconds per run
    "gpt2-tiny": dict(n_embd=128, n_layer=4, n_head=4),     # the default demo
    "gpt2-small-cpu": dict(n_embd=256, n_layer=6, n_head=8),
    "gpt2-medium-cpu": dict(n_embd=512, n_layer=8, n_head=8),
    "gpt2-bench": dict(n_embd=1024, n_layer=4, n_head=16),  # bench/bench_gpt2_tp.py's shape
}
MOE_PRESETS: dict[str, dict] = {  # Mixtral: attention as Mistral's, 4 experts per layer, 2 per token
    "mixtral-micro": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "mixtral-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
}
PRESETS.update(MOE_PRESETS)
DEFAULT_PRESET = "gpt2-tiny"
_DEFAULT_POSITIONS = 1024


def preset_config(name: str, seq_len: int):
    """The config of a preset (``GPT2Config``, or ``MixtralConfig`` for a mixture-of-experts one),
    sized for the byte tokenizer and at least ``seq_len``."""
    from transformers import GPT2Config, MixtralConfig

    tok = ByteTokenizer
    ids = dict(vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if name in MOE_PRESETS:
        return MixtralConfig(max_position_embeddings=max(_DEFAULT_POSITIONS, seq_len), **ids, **MOE_PRESETS[name])
    return GPT2Config(n_positions=max(_DEFAULT_POSITIONS, seq_len), resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, **ids, **PRESETS[name])


def preset_shape(name: str, seq_len: int) -> SimpleNamespace:
    """What ``size_problems`` reads of a preset's config (its type, heads, layers, positions and
    experts), from ``PRESETS`` alone: the launcher checks a preset run without importing
    transformers, which costs seconds in every launch. Its answers are ``preset_config``'s
    (tests/cli/test_cli_imports.py compares them)."""
    sizes = PRESETS[name]
    if name in MOE_PRESETS:
        return SimpleNamespace(model_type="mixtral", num_attention_heads=sizes["num_attention_heads"],
                               num_hidden_layers=sizes["num_hidden_layers"],
                               num_local_experts=sizes["num_local_experts"],
                               max_position_embeddings=max(_DEFAULT_POSITIONS, seq_len))
    return SimpleNamespace(model_type="gpt2", num_attention_heads=sizes["n_head"], num_hidden_layers=sizes["n_layer"],
                           max_position_embeddings=max(_DEFAULT_POSITIONS, seq_len))


def is_model_dir(model: str) -> bool:
    return Path(model).is_dir()


def load_config(model: str, seq_len: int):
    """The model's config without building it, so the launcher can check sizes before starting
    any rank.

    Raises:
        ValueError: for a name that is neither a preset nor a directory with a ``config.json``.
    """
    if model in PRESETS:
        return preset_config(model, seq_len)
    if not is_model_dir(model):
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json in that directory (expected a Hugging Face "
                         "model saved with save_pretrained)")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model)


def causal_lm_problems(model: str, config) -> list[str]:
    """Refuse a model directory that is not a causal language model (an encoder such as BERT):
    ``AutoModelForCausalLM`` would build some LM head for it anyway and the load would then fail
    on every rank over weights the directory never had.

    The config's ``architectures`` (what the directory was saved from) decides; a config without
    it is judged by its ``model_type``."""
    if model in PRESETS:
        return []
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    causal = {name for v in CAUSAL.values() for name in ((v,) if isinstance(v, str) else v)}
    archs = list(getattr(config, "architectures", None) or [])
    if archs and not any(a in causal for a in archs):
        return [f"--model {model}: this is not a causal LM: its config.json names architecture "
                f"{', '.join(archs)} (model_type {config.model_type!r}); train needs a causal language model "
                "saved from a class such as GPT2LMHeadModel or LlamaForCausalLM"]
    if not archs and config.model_type not in CAUSAL:
        return [f"--model {model}: this is not a causal LM: model_type {config.model_type!r} has no causal "
                "language model class in transformers"]
    return []


def max_positions(config) -> int | None:
    """The longest sequence the model can embed, whatever its config calls it."""
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def size_problems(config, seq_len: int, tp: int, pp: int = 1, ep: int = 1) -> list[str]:
    """Mismatches between the model and the run that would otherwise fail on every rank after
    launch (the walker and the expert checks too, but by then N tracebacks bury the message)."""
    problems = expert_problems(config, ep)
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        problems.append(f"--seq-len {seq_len} exceeds the model's {limit} positions")
    heads = getattr(config, "n_head", None) or getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads % tp:
        problems.append(f"the model has {heads} attention heads, not divisible by --tp {tp}")
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < pp:
        problems.append(f"the model has {layers} layers, fewer than --pp {pp} stages")
    return problems


def expert_problems(config, ep: int) -> list[str]:
    """``--ep`` against the model: a mixture-of-experts architecture with a built-in expert
    layout whose number of experts the degree divides."""
    if ep <= 1:  # 1: nothing to check; below 1 the range check reports it
        return []
    from ..models import BUILT_IN, architecture_for

    layout = getattr(architecture_for(config), "experts", None)
    if layout is None:
        moe = ", ".join(t for t, a in BUILT_IN.items() if a.experts)
        return [f"--ep {ep} needs a mixture-of-experts model ({moe}; presets "
                f"{', '.join(MOE_PRESETS)}), the model's model_type is {config.model_type!r}"]
    experts = getattr(config, layout.num_experts)
    return [f"the model has {experts} experts per layer, not divisible by --ep {ep}"] if experts % ep else []


def load_tokenizer(model: str):
    """A directory's own tokenizer; the byte tokenizer for presets and for tokenizer-less
    directories whose vocabulary is the byte tokenizer's (models saved from a preset run).

    Raises:
        ValueError: for a directory with neither a tokenizer nor a byte-sized vocabulary.
    """
    if model in PRESETS:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, TypeError) as exc:
        tok, reason = None, str(exc)
    if tok is not None and _has_vocabulary(tok):
        return tok
    if getattr(load_config(model, 0), "vocab_size", None) == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    raise ValueError(f"--model {model}: no usable tokenizer in the directory "
                     f"({reason if tok is None else 'its tokenizer has an empty vocabulary'})")


def _has_vocabulary(tok) -> bool:
    """False for the empty tokenizer transformers builds when a directory has no tokenizer files
    (it loads without error and encodes every text to nothing)."""
    return len(tok) > 1 and len(tok.encode("def f(x):", add_special_tokens=False)) > 0


def build_model(model: str, seq_len: int, seed: int):
    """The unsharded model. Every rank builds it from the same seed, so all ranks start from the
    same weights before ``DistributedModel`` keeps each rank's slice."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    torch.manual_seed(seed)
    if model in MOE_PRESETS:
        return AutoModelForCausalLM.from_config(preset_config(model, seq_len))
    if model in PRESETS:
        return GPT2LMHeadModel(preset_config(model, seq_len))
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)


def build_distributed(model: str, seq_len: int, seed: int):
    """The ``DistributedModel`` to train. A preset is built whole from ``seed`` on every rank; a
    model directory is built on the meta device and read shard-on-read, so no rank ever holds
    the full pretrained model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import modelparallel as smp

    if model in PRESETS:
        return smp.DistributedModel(build_model(model, seq_len, seed))
    with torch.device("meta"):
        dist_model = smp.DistributedModel(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)))
    smp.load_hf_checkpoint(dist_model, model)
    return dist_model
