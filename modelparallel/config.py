"""The job configuration, with SageMaker model parallelism's key names, validated once.

A config arrives as a dict, a path to a JSON file, or the ``MODELPARALLEL_CONFIG`` environment
variable (either of those two forms). Validation happens before any collective runs, and a bad
config raises one ``ValueError`` that lists every problem, so a user fixes them all in one go.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

ENV_VAR = "MODELPARALLEL_CONFIG"

_PLACEMENTS = ("cluster", "spread")


@dataclass(frozen=True)
class Config:
    """Parallelism settings; field names are SageMaker's so existing configs carry over."""

    tensor_parallel_degree: int = 1
    """Ranks that share one copy of each layer, each holding 1/degree of its weights."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages. Only 1 is supported; anything else is refused."""
    ddp: bool = True
    """Average gradients over data-parallel replicas (the ranks with the same tp_rank)."""
    sharded_data_parallel_degree: int = 1
    """SageMaker v1 name for sharding parameters/gradients/optimizer state over data-parallel ranks."""
    hybrid_shard_degree: int = 1
    """SageMaker v2 name for the same setting; give one or the other, or both equal."""
    fp16: bool = False
    """Train in float16 (use a ``DistributedOptimizer`` with loss scaling)."""
    bf16: bool = False
    """Train in bfloat16."""
    random_seed: int = 12345
    """Seed set on every rank by ``init``, so every rank builds the same initial model."""
    placement_strategy: str = "cluster"
    """How ranks map to the (dp, tp) mesh: "cluster" puts a TP group on consecutive ranks (one
    node first), "spread" strides it; "DPT"/"TPD"-style letter orders are also accepted."""
    offload_activations: bool = False
    """Keep activation-checkpointed modules' saved inputs in host memory until backward (v1 name)."""
    sm_activation_offloading: bool = False
    """SageMaker v2 name of ``offload_activations``."""
    activation_loading_horizon: int = 4
    """How many checkpointed regions ahead of backward offloaded activations are loaded back."""
    world_size: int = field(default=1, compare=False)
    """Filled in by ``init`` from the launcher; not a user key."""

    @property
    def dp_degree(self) -> int:
        """Data-parallel replicas: ranks that hold the same tensor-parallel shard."""
        return self.world_size // (self.tensor_parallel_degree * self.pipeline_parallel_degree)

    @property
    def shard_degree(self) -> int:
        """The sharded-data-parallel degree, whichever of its two names was used."""
        return max(self.sharded_data_parallel_degree, self.hybrid_shard_degree)


def _user_keys() -> set[str]:
    return {f.name for f in dataclasses.fields(Config)} - {"world_size"}


def load_raw(config: dict | str | os.PathLike | None) -> dict[str, Any]:
    """Return the user's config as a dict, from a dict, a JSON path, or the environment."""
    if config is None:
        config = os.environ.get(ENV_VAR)
        if not config:
            return {}
        if config.lstrip().startswith("{"):
            return json.loads(config)
    if isinstance(config, dict):
        return dict(config)
    with open(config, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"config file {config} must hold a JSON object, found {type(data).__name__}")
    return data


def _check_types(raw: dict[str, Any], problems: list[str]) -> None:
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    for key, value in raw.items():
        want = types[key]
        if want == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{key} must be an integer, got {value!r}")
        elif want == "bool" and not isinstance(value, bool):
            problems.append(f"{key} must be true or false, got {value!r}")
        elif want == "str" and not isinstance(value, str):
            problems.append(f"{key} must be a string, got {value!r}")


def _check_placement(value: str, problems: list[str]) -> None:
    if value in _PLACEMENTS:
        return
    if sorted(value.upper()) != ["D", "P", "T"]:
        problems.append(
            f"placement_strategy must be 'cluster', 'spread' or an order of the letters D, P, T "
            f"(e.g. 'DPT'), got {value!r}"
        )


def _check_degrees(cfg: Config, problems: list[str]) -> None:
    tp, pp, world = cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree, cfg.world_size
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree",
                "sharded_data_parallel_degree", "hybrid_shard_degree"):
        if getattr(cfg, key) < 1:
            problems.append(f"{key} must be >= 1, got {getattr(cfg, key)}")
    if pp > 1:
        problems.append(f"pipeline_parallel_degree={pp} is not supported (pipeline parallelism: only 1)")
    if tp >= 1 and pp >= 1 and world % (tp * pp) != 0:
        problems.append(
            f"world size {world} is not divisible by tensor_parallel_degree {tp} x "
            f"pipeline_parallel_degree {pp} = {tp * pp}"
        )
    sdp, hsd = cfg.sharded_data_parallel_degree, cfg.hybrid_shard_degree
    if sdp > 1 and hsd > 1 and sdp != hsd:
        problems.append(
            f"sharded_data_parallel_degree={sdp} and hybrid_shard_degree={hsd} name the same setting "
            "and disagree"
        )
    shard = cfg.shard_degree
    if shard > 1 and tp >= 1 and pp >= 1 and world % (tp * pp) == 0 and cfg.dp_degree % shard:
        problems.append(
            f"sharded data parallel degree {shard} does not divide the data-parallel degree "
            f"{cfg.dp_degree} (world {world} / tensor_parallel_degree {tp})"
        )
    if cfg.activation_loading_horizon < 1:
        problems.append(f"activation_loading_horizon must be >= 1, got {cfg.activation_loading_horizon}")
    if cfg.fp16 and cfg.bf16:
        problems.append("fp16 and bf16 are both true; choose one")


def build_config(config: dict | str | os.PathLike | None, world_size: int) -> Config:
    """Parse and validate a config for a job of ``world_size`` ranks.

    Raises:
        ValueError: listing every unknown key, wrong type and inconsistent degree at once.
    """
    raw = load_raw(config)
    problems: list[str] = []
    unknown = sorted(set(raw) - _user_keys())
    if unknown:
        problems.append(f"unknown config keys {unknown}; known keys are {sorted(_user_keys())}")
    known = {k: v for k, v in raw.items() if k in _user_keys()}
    type_problems: list[str] = []
    _check_types(known, type_problems)
    if type_problems:
        raise ValueError("invalid modelparallel config:\n  - " + "\n  - ".join(problems + type_problems))
    cfg = Config(**known, world_size=world_size)
    _check_placement(cfg.placement_strategy, problems)
    _check_degrees(cfg, problems)
    if problems:
        raise ValueError("invalid modelparallel config:\n  - " + "\n  - ".join(problems))
    return cfg
