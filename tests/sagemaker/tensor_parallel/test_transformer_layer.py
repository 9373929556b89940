"""``modelparallel.sagemaker.tensor_parallel.transformer.TransformerLayer``: the class v2 scripts give FSDP's
``transformer_auto_wrap_policy`` and ``apply_activation_checkpointing`` at TP > 1.

A failure means ``transform`` did not mark the Hugging Face blocks (FSDP would then wrap nothing
but the root and activation checkpointing would apply to nothing), or marked other modules.
"""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import modelparallel as smp
from modelparallel.sagemaker.tensor_parallel.transformer import TransformerLayer


@pytest.mark.parametrize("build,block", [
    (lambda: LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=50)),
     LlamaDecoderLayer),
    (lambda: GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=16)), GPT2Block),
])
def test_transform_marks_the_blocks(build, block):
    smp.init({})
    torch.manual_seed(0)
    model = build()
    assert not any(isinstance(m, TransformerLayer) for m in model.modules()), "marked before transform"
    model = smp.transform(model)
    marked = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert len(marked) == 2 and all(type(m) is block for m in marked)
    assert isinstance(marked[0], (TransformerLayer,)) and not isinstance(model, TransformerLayer)


def test_not_instantiable():
    with pytest.raises(NotImplementedError, match="Hugging Face blocks"):
        TransformerLayer()
