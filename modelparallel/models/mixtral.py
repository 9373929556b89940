"""Mixtral (``MixtralModel``, ``MixtralForCausalLM``...): Mistral's attention with a sparse MoE
feed-forward in every layer.

Tensor parallelism covers the attention exactly as Llama's (q, k, v column parallel, whole query
and key/value heads per rank, o row parallel) and the vocabulary-parallel embedding and LM head.
Each layer's MoE block (``mlp``) holds a router (``gate``, a ``[num_experts, hidden]`` weight)
and the experts stacked in two tensors (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj
[E, H, I]``): neither is an ``nn.Linear``, so the TP walker leaves them whole on every TP rank
(every TP rank of a group holds the same tokens there); expert parallelism shards the experts on
their first dimension (``EXPERTS``), with ``expert_tensor_parallel`` each expert over the TP
ranks too (``expert/tensor_parallel.py``), and the router stays whole on every rank. No weight is fused
in a way that depends on a degree: the distributed state dict is HF's, experts indexed globally.
Checkpoints on the Hugging Face hub hold each expert's ``w1`` (gate), ``w3`` (up) and ``w2``
(down) separately under ``block_sparse_moe``: ``TABLE.stacked`` / ``renamed`` read them.
Context parallelism reaches the attention as Llama's (HF's attention interface); the MoE block
routes each token on its own, so it runs on a sequence's part unchanged.
"""

from ..expert.layout import ExpertLayout
from . import llama
from ._translate import KeyTable
from ..tp.plan import ArchSpec, ModulePlan, SharedInput
from ._architecture import Architecture
from ._parts import LM_HEAD, ROUTER_LOSS_ON_SHARDS, column_row

SPEC = ArchSpec(
    model_type="mixtral",
    base=ModulePlan(
        rules={"embed_tokens": "vocab_embedding",
               **column_row("layers.*.self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj")},
        shared_inputs={"layers.*.self_attn": SharedInput(arg="hidden_states")},
    ),
    head=LM_HEAD,
    divisible_config=("num_attention_heads", "num_key_value_heads"),
    loss="causal",
    sequence_unsupported=(ROUTER_LOSS_ON_SHARDS,),
)

EXPERTS = ExpertLayout(experts="layers.*.mlp.experts", router="layers.*.mlp.gate", num_experts="num_local_experts")

TABLE = KeyTable(
    arch="mixtral",
    base_prefix="model",
    base_keys=(
        "embed_tokens.weight", "norm.weight",
        "layers.{}.input_layernorm.weight", "layers.{}.post_attention_layernorm.weight",
        "layers.{}.self_attn.q_proj.weight", "layers.{}.self_attn.k_proj.weight",
        "layers.{}.self_attn.v_proj.weight", "layers.{}.self_attn.o_proj.weight",
        "layers.{}.mlp.gate.weight", "layers.{}.mlp.experts.gate_up_proj", "layers.{}.mlp.experts.down_proj",
    ),
    head_keys=("lm_head.weight", "score.weight", "score.bias", "classifier.weight", "classifier.bias",
               "qa_outputs.weight", "qa_outputs.bias"),
    tied={"lm_head.weight": "model.embed_tokens.weight"},
    stacked={"layers.{}.mlp.experts.gate_up_proj": ("layers.{}.block_sparse_moe.experts.{}.w1.weight",
                                                    "layers.{}.block_sparse_moe.experts.{}.w3.weight"),
             "layers.{}.mlp.experts.down_proj": ("layers.{}.block_sparse_moe.experts.{}.w2.weight",)},
    renamed={"layers.{}.block_sparse_moe.gate.weight": "layers.{}.mlp.gate.weight"},
)

PIPELINE = llama.PIPELINE  # the same base-model tree: embed_tokens, layers, norm
CONTEXT = llama.CONTEXT  # the same attention modules (model.layers.*.self_attn)

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, experts=EXPERTS, context=CONTEXT)
