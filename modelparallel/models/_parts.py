"""Plan parts several architectures share (not an architecture: the registry skips ``_`` files)."""

from ..tp.plan import ArchSpec, ModulePlan, Unsupported

LM_HEAD = ModulePlan(rules={"lm_head": "vocab_colwise"}, optional_rules=("lm_head",))
"""An ``lm_head`` sharded over the vocabulary (its logits stay sharded for the loss), present
only in the LM head classes."""

ROUTER_LOSS_ON_SHARDS = Unsupported("the router's load-balancing loss (output_router_logits)",
                                    when={"output_router_logits": True})
"""Under sequence parallelism a MoE router routes each rank's tokens alone, which is exact, but
the load-balancing loss multiplies two means over all the batch's tokens: on a sequence shard
each rank would take its own."""


def column_row(prefix: str, columns: tuple[str, ...], row: str) -> dict[str, str]:
    """Rules for one Megatron pair under ``prefix``: ``columns`` column parallel (whole heads or
    feed-forward slices per rank), then ``row`` row parallel (one all-reduce of its output)."""
    return {**{f"{prefix}.{c}": "colwise" for c in columns}, f"{prefix}.{row}": "rowwise"}


def decoder_lm(model_type: str, embedding: str, attention: str, qkv: tuple[str, ...], out: str, mlp: str,
               up: tuple[str, ...], down: str, divisible: tuple[str, ...],
               per_rank: tuple[str, ...] = (), **plan_fields) -> ArchSpec:
    """A decoder-only LM with separate q/k/v projections: vocab-parallel ``embedding``, each
    block's attention and MLP a Megatron pair, the ``lm_head`` vocab-parallel, causal loss.

    Args:
        model_type: the HF ``config.model_type``.
        embedding: the token embedding's path in the base model.
        attention, qkv, out: the attention module's glob, its column-parallel projections and its
            row-parallel output.
        mlp, up, down: the same for the feed-forward.
        divisible: config head counts the degree must divide.
        per_rank: attributes of the attention module its forward reshapes with (divided per rank).
        plan_fields: any other ``ModulePlan`` field of the base plan.

    Returns:
        The architecture's ``ArchSpec``.
    """
    return ArchSpec(
        model_type=model_type,
        base=ModulePlan(
            rules={embedding: "vocab_embedding", **column_row(attention, qkv, out), **column_row(mlp, up, down)},
            per_rank_attrs={attention: per_rank} if per_rank else {},
            **plan_fields,
        ),
        head=LM_HEAD,
        divisible_config=divisible,
        loss="causal",
    )
