"""GPT-2 (``GPT2Model``, ``GPT2LMHeadModel``, ``GPT2ForSequenceClassification``...).

HF's ``Conv1D`` stores weights as [in, out]; the styles pick the right dimension from the module
type. ``c_attn`` fuses q|k|v along its output (dim 1 of the weight, dim 0 of the bias), so it is
packed in 3 chunks and each rank gets its own heads of all three; the distributed state dict keeps
the chunks as their own dimension ([in, 3, out/3]), independent of the degree. The attention
module reshapes with ``num_heads``, ``split_size`` and ``embed_dim``, which become per-rank values.
``wte`` is vocab-parallel and the LM head, tied to it, keeps its logits vocab-sharded for the loss.
Older HF checkpoints also stored a causal mask and a masked bias per layer; they are dropped on
import and re-created on export when asked for.
"""

from ..context.spec import ContextSpec
from ._translate import KeyTable, causal_mask, masked_bias
from ..pipeline.split import PipelineSplit
from ..tp.plan import ArchSpec, ModulePlan, Packed, packed_keys
from ._architecture import Architecture
from ._parts import LM_HEAD, column_row
from ._sagemaker import SageMakerLayout

PACKED = {"h.*.attn.c_attn": Packed(chunks=3, dims={"weight": 1, "bias": 0})}

SPEC = ArchSpec(
    model_type="gpt2",
    base=ModulePlan(
        rules={
            "wte": "vocab_embedding",
            "h.*.attn.c_attn": "packed_colwise",
            "h.*.attn.c_proj": "rowwise",
            **column_row("h.*.mlp", ("c_fc",), "c_proj"),
        },
        packed=PACKED,
        per_rank_attrs={"h.*.attn": ("num_heads", "split_size", "embed_dim")},
    ),
    head=LM_HEAD,
    loss="causal",
)

PIPELINE = PipelineSplit(blocks="h", first=("wte", "wpe"), last=("ln_f",))
"""Token and position embeddings on the first stage, the final norm (and the head) on the last."""
CONTEXT = ContextSpec(attention="h.*.attn")  # HF's attention interface (its scale includes the layer scaling)

GPT_KEYS = (
    "wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias",
    "h.{}.ln_1.weight", "h.{}.ln_1.bias", "h.{}.ln_2.weight", "h.{}.ln_2.bias",
    "h.{}.mlp.c_fc.weight", "h.{}.mlp.c_fc.bias", "h.{}.mlp.c_proj.weight", "h.{}.mlp.c_proj.bias",
)
"""Embeddings, norms and MLP keys of GPT-2's layout, which GPT-Neo keeps."""

TABLE = KeyTable(
    arch="gpt2",
    base_prefix="transformer",
    base_keys=(
        *GPT_KEYS,
        "h.{}.attn.c_attn.weight", "h.{}.attn.c_attn.bias", "h.{}.attn.c_proj.weight", "h.{}.attn.c_proj.bias",
    ),
    head_keys=("lm_head.weight", "score.weight", "score.bias"),
    packed=packed_keys(PACKED),
    tied={"lm_head.weight": "transformer.wte.weight"},
    legacy_buffers={"h.{}.attn.bias": causal_mask, "h.{}.attn.masked_bias": masked_bias(-1e4)},
)

SAGEMAKER = SageMakerLayout(layers="h", attention="attn", output="mlp")
"""SageMaker's ``transformer.seq_layers.N.attention`` / ``.output`` over ``h.N.attn`` / ``h.N.mlp``."""

ARCHITECTURE = Architecture(SPEC, TABLE, pipeline=PIPELINE, context=CONTEXT, sagemaker=SAGEMAKER)
