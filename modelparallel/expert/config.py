"""``MoEConfig``: SageMaker v2's mixture-of-experts options, passed as ``transform(model, config=MoEConfig(...))``.

Field names and defaults are SageMaker's. Each value is either honoured or refused here, by
name, when the config is built (before any collective):

- ``smp_moe``: True: this library's MoE (expert parallelism, the routing options below); False:
  the model's own Hugging Face MoE, untouched (refused with ``expert_parallel_degree`` > 1).
- ``moe_load_balancing``: ``"aux_loss"`` (Hugging Face's router and its auxiliary load-balancing
  loss, weighted by ``moe_aux_loss_coeff``), ``"sinkhorn"`` (experts chosen on Sinkhorn-balanced
  router scores while training, Megatron-Core's definition; no auxiliary loss), ``"none"`` (HF's
  router, no auxiliary loss). ``"balanced"`` raises ``NotImplementedError``.
- ``moe_z_loss_coeff``: weight of the router z-loss (ST-MoE), added to the model's loss.
- ``moe_all_to_all_dispatcher``: tokens travel to their experts by all-to-all (True) or by an
  all-gather of every token of the expert-parallel group (False).
- ``global_token_shuffle``: only False (True raises ``NotImplementedError``).
- ``random_seed``, ``use_cpu_initialization``: accepted, no effect: experts are initialized from
  the model's own initialization or weights, sliced per rank, so nothing random depends on the
  expert-parallel rank, and every tensor starts where the model's tensors are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

LOAD_BALANCING = ("aux_loss", "sinkhorn", "balanced", "none")
"""The ``moe_load_balancing`` values SageMaker documents."""

NOT_BUILT = {"balanced": "token-balanced assignment"}


@dataclass(frozen=True)
class MoEConfig:
    """SageMaker v2's MoE options (see the module docstring for what each one does here).

    Raises:
        ValueError: a field of the wrong type, an unknown ``moe_load_balancing``, a negative
            coefficient; naming the field.
        NotImplementedError: ``moe_load_balancing="balanced"`` or ``global_token_shuffle=True``.
    """

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001
    use_cpu_initialization: bool = False

    def __post_init__(self):
        problems = [_type_problem(f.name, getattr(self, f.name), f.type) for f in fields(self)]
        problems = [p for p in problems if p]
        if self.moe_load_balancing not in LOAD_BALANCING and isinstance(self.moe_load_balancing, str):
            problems.append(f"moe_load_balancing={self.moe_load_balancing!r}: expected one of {LOAD_BALANCING}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                problems.append(f"{name}={value!r} must be >= 0")
        if problems:
            raise ValueError("invalid MoEConfig:\n  - " + "\n  - ".join(problems))
        refused = []
        if self.moe_load_balancing in NOT_BUILT:
            refused.append(f"moe_load_balancing={self.moe_load_balancing!r} "
                           f"({NOT_BUILT[self.moe_load_balancing]} is not built; use 'aux_loss', 'sinkhorn' or 'none')")
        if self.global_token_shuffle:
            refused.append("global_token_shuffle=True (shuffling tokens across the expert-parallel group is not built)")
        if refused:
            raise NotImplementedError("MoEConfig: modelparallel does not implement:\n  - " + "\n  - ".join(refused))


_TYPES = {"bool": (bool, "a bool"), "int": (int, "an int"), "str": (str, "a str"), "float": ((int, float), "a number")}


def _type_problem(name: str, value, kind: str) -> str | None:
    want, said = _TYPES[kind]
    if isinstance(value, bool) and kind != "bool" or not isinstance(value, want):
        return f"{name}={value!r} must be {said}"
    return None
