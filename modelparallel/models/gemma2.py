"""Gemma 2 (``Gemma2Model``, ``Gemma2ForCausalLM``...): Gemma's plan, plus two norms per block.

Gemma 2 adds ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` (replicated, like the
other norms), alternates sliding-window and global layers (in the attention mask), soft-caps the
attention scores per head (``attn_logit_softcapping``: every rank caps its own heads' scores) and
the final logits (``final_logit_softcapping``: ``tanh`` of the vocabulary-sharded logits, an
element-wise op on each rank's slice before the vocabulary-parallel loss). The embedding is scaled
as Gemma's and tied to the LM head. No weight is fused.
"""

from dataclasses import replace

from . import gemma
from ._architecture import Architecture

SPEC = replace(gemma.SPEC, model_type="gemma2")
TABLE = replace(gemma.TABLE, arch="gemma2",
                base_keys=(*gemma.TABLE.base_keys, "layers.{}.pre_feedforward_layernorm.weight",
                           "layers.{}.post_feedforward_layernorm.weight"))

ARCHITECTURE = Architecture(SPEC, TABLE)
