"""Where an architecture keeps its experts: data, one ``ExpertLayout`` per MoE architecture file.

Transformers 5 stores each MoE layer's experts as one module holding stacked tensors, expert
index first (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), next to a router module
(``gate``) that picks each token's top-k experts and their weights. Expert parallelism is then a
layout question: shard the stacked tensors on dimension 0 over the expert-parallel ranks and move
tokens to the rank holding their expert. The layout says which modules those are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    """One architecture's experts.

    Attributes:
        experts: glob (relative to the base model, ``*`` = one path segment) of the experts
            modules: HF's ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, and
            ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``,
            which expert parallelism replaces by the dispatching one.
        router: glob of the router modules (``forward(hidden_states) -> (router_logits,
            top_k_weights, top_k_index)``), kept whole on every rank.
        num_experts: the config attribute holding the number of experts per layer.
        top_k: the config attribute holding the experts each token is routed to.
    """

    experts: str
    router: str
    num_experts: str = "num_experts"
    top_k: str = "num_experts_per_tok"
