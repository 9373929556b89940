"""Qwen2-MoE (``Qwen2MoeModel``, ``Qwen2MoeForCausalLM``...): sparse MoE layers with a shared
expert, optionally interleaved with dense feed-forward layers (``decoder_sparse_step``,
``mlp_only_layers``).

Tensor parallelism: attention as Llama's (q, k, v with their biases column parallel, o row
parallel), and every dense feed-forward as a Megatron pair: a dense layer's ``mlp`` and each
sparse layer's ``mlp.shared_expert`` (gate and up column parallel, down row parallel). Which of
the two a model has depends on its config, so those rules may match nothing. The shared expert's
scalar gate (``shared_expert_gate``, hidden -> 1) stays whole on every rank. The router (``gate``)
and the stacked experts are not ``nn.Linear``: the TP walker leaves them whole; expert
parallelism shards the experts (``EXPERTS``), and with ``expert_tensor_parallel`` each expert
over the TP ranks too (``expert/tensor_parallel.py``). The distributed state dict is HF's; checkpoints
on the Hugging Face hub hold each expert's projections separately (``TABLE.stacked`` reads them).
"""

from ..expert.layout import ExpertLayout
from . import llama
from ._translate import KeyTable
from ..tp.plan import ArchSpec, ModulePlan, SharedInput
from ._architecture import Architecture
from ._parts import LM_HEAD, ROUTER_LOSS_ON_SHARDS, column_row

_DENSE = {**column_row("layers.*.mlp", ("gate_proj", "up_proj"), "down_proj"),
          **column_row("layers.*.mlp.shared_expert", ("gate_proj", "up_proj"), "down_proj")}

SPEC = ArchSpec(
    model_type="qwen2_moe",
    base=ModulePlan(
        rules={"embed_tokens": "vocab_embedding",
               **column_row("layers.*.self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"), **_DENSE},
        optional_rules=tuple(_DENSE),
        shared_inputs={"layers.*.self_attn": SharedInput(arg="hidden_states")},
        replicated=("layers.*.mlp.shared_expert_gate",),
    ),
    head=LM_HEAD,
    divisible_config=("num_attention_heads", "num_key_value_heads"),
    loss="causal",
    sequence_unsupported=(ROUTER_LOSS_ON_SHARDS,),
)

EXPERTS = ExpertLayout(experts="layers.*.mlp.experts", router="layers.*.mlp.gate", num_experts="num_experts")

_MLP = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")

TABLE = KeyTable(
    arch="qwen2_moe",
    base_prefix="model",
    base_keys=(
        "embed_tokens.weight", "norm.weight",
        "layers.{}.input_layernorm.weight", "layers.{}.post_attention_layernorm.weight",
        *(f"layers.{{}}.self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
        *(f"layers.{{}}.mlp.{k}" for k in _MLP),
        *(f"layers.{{}}.mlp.shared_expert.{k}" for k in _MLP),
        "layers.{}.mlp.shared_expert_gate.weight",
        "layers.{}.mlp.gate.weight", "layers.{}.mlp.experts.gate_up_proj", "layers.{}.mlp.experts.down_proj",
    ),
    head_keys=("lm_head.weight", "score.weight", "score.bias", "classifier.weight", "classifier.bias",
               "qa_outputs.weight", "qa_outputs.bias"),
    tied={"lm_head.weight": "model.embed_tokens.weight"},
    stacked={"layers.{}.mlp.experts.gate_up_proj": ("layers.{}.mlp.experts.{}.gate_proj.weight",
                                                    "layers.{}.mlp.experts.{}.up_proj.weight"),
             "layers.{}.mlp.experts.down_proj": ("layers.{}.mlp.experts.{}.down_proj.weight",)},
)

PIPELINE = llama.PIPELINE  # the same base-model tree: embed_tokens, layers, norm

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, experts=EXPERTS)
