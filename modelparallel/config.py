"""The job configuration, with SageMaker model parallelism's key names, validated once.

A config arrives as a dict, a path to a JSON file, or the ``MODELPARALLEL_CONFIG`` environment
variable (either of those two forms). Validation happens before any collective runs, and a bad
config raises one ``ValueError`` that lists every problem, so a user fixes them all in one go.
The rules relating keys to each other and to the world size are in ``config_checks``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import field
from difflib import get_close_matches
from typing import Any

from .config_checks import (  # noqa: F401 - part of this module's API
    PIPELINE_SCHEDULES, STAGING_MODES, _check_degrees, _check_pipeline, _check_placement, _check_virtual,
    _unbuilt_virtual, unbuilt_combinations, virtual_round_problem)
from .config_keys import ALIASES, BY_NAME, DEFAULT_ONLY, KEYS, NO_EFFECT

ENV_VAR = "MODELPARALLEL_CONFIG"


def _fields() -> list[tuple[str, type, Any]]:
    return [(k.name, k.type, field(default=k.default)) for k in KEYS] + [
        ("world_size", int, field(default=1, compare=False))]


class _Derived:
    """Quantities computed from the keys (mixed into ``Config``)."""

    @property
    def dp_degree(self) -> int:
        """Replicas of one model copy: the size of the mesh's "dp" dimension (SageMaker's
        reduced-data-parallel group, ranks with the same tp and pp rank)."""
        return self.world_size // self.model_ranks

    @property
    def replica_degree(self) -> int:
        """Ranks holding the same parameters (same tp and pp rank): the data-parallel degree
        times the context-parallel degree. Gradients are averaged, and FSDP shards, over them;
        data is sharded over the data-parallel ranks only (context ranks split one sequence)."""
        return self.dp_degree * self.context_parallel_degree

    @property
    def model_ranks(self) -> int:
        """Ranks that one replica spans: tensor x pipeline x context parallel degrees."""
        return self.tensor_parallel_degree * self.pipeline_parallel_degree * self.context_parallel_degree

    @property
    def shard_degree(self) -> int:
        """The v1 sharded-data-parallel degree ``DistributedModel`` applies (1 = off), from
        ``sharded_data_parallel_degree``, an explicit ``hybrid_shard_degree`` > 1, or
        ``shard_optimizer_state`` (every replica: rdp x cp ranks)."""
        sdp, hsd = self.sharded_data_parallel_degree, self.hybrid_shard_degree
        if sdp > 1 or hsd > 1:
            return sdp if sdp > 1 else hsd
        return self.replica_degree if self.shard_optimizer_state else 1

    @property
    def keep_params_gathered(self) -> bool:
        """``shard_optimizer_state`` alone asks for optimizer-state (and gradient) sharding, not
        for parameters gathered anew in backward: FSDP then keeps each block's parameters
        gathered from forward to backward (ZeRO-2), trading that memory for the extra gathers."""
        return self.shard_optimizer_state and self.sharded_data_parallel_degree <= 1 \
            and self.hybrid_shard_degree <= 1

    @property
    def fsdp_shard_degree(self) -> int:
        """The v2 FSDP sharding degree: ``hybrid_shard_degree``, or every replica (data x context
        ranks) when it is 0 (v2's default, full sharding)."""
        return self.hybrid_shard_degree or self.replica_degree

    @property
    def scaled_batch(self) -> bool:
        """Whether the tensor-parallel group computes on the union of its ranks' batches
        (``prescaled_batch`` false and TP > 1): each TP rank brought its own batch."""
        return not self.prescaled_batch and self.tensor_parallel_degree > 1

    @property
    def activation_offloading(self) -> bool:
        """Whether activation offloading is asked for, under its v1 or v2 name."""
        return self.offload_activations or self.sm_activation_offloading


Config = dataclasses.make_dataclass(
    "Config", _fields(), bases=(_Derived,), frozen=True,
    namespace={"__doc__": "Parallelism settings: one field per key of ``config_keys.KEYS`` "
                          "(SageMaker's names), plus ``world_size`` filled in by ``init``.",
               "__module__": __name__})


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


def _coerce(key: str, value: Any, problems: list[str]) -> Any:
    """``value`` as the key's type (an integral float such as 5e8 counts as an int)."""
    want = BY_NAME[key].type
    if want is bool:
        if not isinstance(value, bool):
            problems.append(f"{key} must be true or false, got {value!r}")
        return value
    if want is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key} must be an integer, got {value!r}")
        return value
    if want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{key} must be a number, got {value!r}")
            return value
        return float(value)
    if not isinstance(value, want):
        problems.append(f"{key} must be a {want.__name__}, got {value!r}")
    return value


def _resolve_aliases(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    out = {k: v for k, v in raw.items() if k not in ALIASES}
    for alias, key in ALIASES.items():
        if alias not in raw:
            continue
        if key in raw and raw[key] != raw[alias]:
            problems.append(f"{alias}={raw[alias]!r} and {key}={raw[key]!r} name the same setting and disagree")
        out.setdefault(key, raw[alias])
    return out


def _unknown(keys: set[str]) -> list[str]:
    problems = []
    for key in sorted(keys):
        close = get_close_matches(key, sorted(set(BY_NAME) | set(ALIASES)), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(f"unknown config key {key!r}{hint} (every key: modelparallel.config_keys.KEYS)")
    return problems


def build_config(config: dict | str | os.PathLike | None, world_size: int, api: str | None = None) -> Config:
    """Parse and validate a config for a job of ``world_size`` ranks.

    Args:
        config: a dict, a JSON path, or None for the environment.
        world_size: ranks in the job.
        api: "v2" when ``transform`` starts the job (refuses what only the v1 API runs).

    Raises:
        ValueError: listing every unknown key (with a suggestion), wrong type and inconsistent
            degree at once (and whatever is not implemented, when there is both).
        NotImplementedError: naming each key given a non-default value that is not built, and
            each combination of dimensions that is not (``unbuilt_combinations``).
    """
    problems: list[str] = []
    raw = _resolve_aliases(load_raw(config), problems)
    problems += _unknown(set(raw) - set(BY_NAME))
    type_problems: list[str] = []
    known = {k: _coerce(k, v, type_problems) for k, v in raw.items() if k in BY_NAME}
    if type_problems:
        problems += type_problems
        raise ValueError("invalid modelparallel config:\n  - " + "\n  - ".join(problems))
    cfg = Config(**known, world_size=world_size)
    _check_placement(cfg.placement_strategy, problems)
    _check_degrees(cfg, problems)
    _check_pipeline(cfg, problems)
    _check_virtual(cfg, problems)
    refused = _unbuilt(known) + _unbuilt_virtual(cfg) + unbuilt_combinations(cfg, api)
    if problems:
        raise ValueError("invalid modelparallel config:\n  - " + "\n  - ".join(
            problems + [f"not implemented: {r}" for r in refused]))
    if refused:
        raise NotImplementedError("modelparallel does not implement:\n  - " + "\n  - ".join(refused))
    return cfg


def _unbuilt(known: dict[str, Any]) -> list[str]:
    """The keys whose non-default value would change results and is not built."""
    return [f"{k}={v!r} (only {BY_NAME[k].default!r} is supported: {BY_NAME[k].doc})"
            for k, v in known.items() if BY_NAME[k].status == DEFAULT_ONLY and v != BY_NAME[k].default]


def without_effect(config: dict | str | os.PathLike | None) -> dict[str, Any]:
    """The keys of a raw config that are accepted but change nothing here, with their values."""
    raw = _resolve_aliases(load_raw(config), [])
    return {k: v for k, v in raw.items() if k in BY_NAME and BY_NAME[k].status == NO_EFFECT}
