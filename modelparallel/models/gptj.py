"""GPT-J (``GPTJModel``, ``GPTJForCausalLM``...).

Each block runs attention and MLP in parallel off one LayerNorm; both are Megatron column/row
pairs. q, k and v are separate ``nn.Linear`` layers whose outputs are whole heads when sharded
by rows, and the rotary embedding is applied per head (to its first ``rotary_dim`` features),
so a rank's heads rotate exactly as in the full model. ``GPTJAttention`` reshapes with
``num_attention_heads`` (``head_dim`` stays), so that one becomes per rank; ``embed_dim`` is
only read in ``__init__``. The LM head is untied and has a bias, sharded with its rows. No weight
is fused. Older HF checkpoints stored a causal mask and masked bias per layer; current ones keep
only weights (the rotary table ``embed_positions`` is recomputed).
"""

from ..context.spec import ContextSpec
from ._translate import KeyTable, causal_mask, masked_bias
from ..pipeline.split import PipelineSplit
from ..tp.plan import SharedInput
from ._architecture import Architecture
from ._parts import decoder_lm
from ._sagemaker import SageMakerLayout

SPEC = decoder_lm(
    "gptj", embedding="wte",
    attention="h.*.attn", qkv=("q_proj", "k_proj", "v_proj"), out="out_proj",
    mlp="h.*.mlp", up=("fc_in",), down="fc_out",
    divisible=("num_attention_heads",), per_rank=("num_attention_heads",),
    shared_inputs={"h.*": SharedInput(output_of="ln_1")},  # q, k, v and fc_in read ln_1's output
)

PIPELINE = PipelineSplit(blocks="h", first=("wte",), last=("ln_f",))
CONTEXT = ContextSpec(  # GPTJAttention._attn(q, k, v, mask) divides q . k by sqrt(head_dim) itself
    attention="h.*.attn", method="_attn", scale=lambda attn: 1 / attn.scale_attn,
    dropout=lambda attn: attn.attn_dropout.p)

TABLE = KeyTable(
    arch="gptj",
    base_prefix="transformer",
    base_keys=(
        "wte.weight", "ln_f.weight", "ln_f.bias", "h.{}.ln_1.weight", "h.{}.ln_1.bias",
        "h.{}.attn.q_proj.weight", "h.{}.attn.k_proj.weight", "h.{}.attn.v_proj.weight",
        "h.{}.attn.out_proj.weight", "h.{}.mlp.fc_in.weight", "h.{}.mlp.fc_in.bias",
        "h.{}.mlp.fc_out.weight", "h.{}.mlp.fc_out.bias",
    ),
    head_keys=("lm_head.weight", "lm_head.bias", "score.weight"),
    legacy_buffers={"h.{}.attn.bias": causal_mask, "h.{}.attn.masked_bias": masked_bias(-1e9)},
)

SAGEMAKER = SageMakerLayout(layers="h", attention="attn", output="mlp", scores_in_fp32=True)
"""SageMaker's tree over ``h.N.attn`` / ``h.N.mlp``; ``GPTJAttention._attn`` scores in float32."""

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, context=CONTEXT, sagemaker=SAGEMAKER)
