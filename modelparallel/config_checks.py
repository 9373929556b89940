"""What a parsed ``Config`` must satisfy, each problem a sentence naming its keys: degrees that
divide the world size, placement, pipeline and staging settings, rounds of the interleaved
schedule, and combinations of dimensions that are not built here.

Kept apart from ``config.py`` (reading, coercing and assembling the keys) because these rules
relate the keys to one another and to the world size; ``build_config`` collects them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config_keys import KEYS, PLACEMENTS

if TYPE_CHECKING:
    from .config import Config


def _check_placement(value: str, problems: list[str]) -> None:
    if value in PLACEMENTS:
        return
    if sorted(value.upper()) != ["D", "P", "T"]:
        problems.append(
            f"placement_strategy must be 'cluster', 'spread' or an order of the letters D, P, T "
            f"(e.g. 'DPT'), got {value!r}"
        )


def _check_degrees(cfg: Config, problems: list[str]) -> None:
    world = cfg.world_size
    for key in KEYS:
        if key.minimum is not None and getattr(cfg, key.name) < key.minimum:
            problems.append(f"{key.name} must be >= {key.minimum}, got {getattr(cfg, key.name)}")
    factors = {k: getattr(cfg, k) for k in ("tensor_parallel_degree", "pipeline_parallel_degree",
                                            "context_parallel_degree")}
    valid = all(v >= 1 for v in factors.values())
    if valid and world % cfg.model_ranks != 0:
        shown = " x ".join(f"{k} {v}" for k, v in factors.items() if v > 1 or k == "tensor_parallel_degree")
        problems.append(f"world size {world} is not divisible by {shown} = {cfg.model_ranks}")
    ep = cfg.expert_parallel_degree
    if valid and ep > 1 and world % cfg.model_ranks == 0 and cfg.dp_degree % ep:
        shown = " x ".join(f"{k} {v}" for k, v in factors.items() if v > 1 or k == "tensor_parallel_degree")
        problems.append(
            f"world size {world} is not divisible by expert_parallel_degree {ep} x {shown} = {ep * cfg.model_ranks} "
            f"(the expert-parallel ranks are data-parallel ranks: {ep} must divide {cfg.dp_degree})")
    sdp, hsd = cfg.sharded_data_parallel_degree, cfg.hybrid_shard_degree
    if sdp > 1 and hsd > 1 and sdp != hsd:
        problems.append(
            f"sharded_data_parallel_degree={sdp} and hybrid_shard_degree={hsd} name the same setting "
            "and disagree"
        )
    shard = cfg.shard_degree
    if shard > 1 and valid and world % cfg.model_ranks == 0 and cfg.replica_degree % shard:
        what = "data-parallel degree" if cfg.context_parallel_degree == 1 else "data x context parallel degree"
        problems.append(
            f"sharded data parallel degree {shard} does not divide the {what} "
            f"{cfg.replica_degree} (world {world} / {cfg.model_ranks // cfg.context_parallel_degree} ranks "
            "per model replica)"
        )
    if cfg.fp16 and cfg.bf16:
        problems.append("fp16 and bf16 are both true; choose one")


PIPELINE_SCHEDULES = ("interleaved", "simple")
STAGING_MODES = ("auto", "memory", "journal")


def _check_pipeline(cfg: Config, problems: list[str]) -> None:
    if cfg.checkpoint_staging not in STAGING_MODES:
        problems.append(f"checkpoint_staging must be one of {STAGING_MODES}, got {cfg.checkpoint_staging!r}")
    if cfg.pipeline not in PIPELINE_SCHEDULES:
        problems.append(f"pipeline must be one of {PIPELINE_SCHEDULES}, got {cfg.pipeline!r}")
    if cfg.pipeline_parallel_degree > 1 and cfg.default_partition >= cfg.pipeline_parallel_degree:
        problems.append(f"default_partition {cfg.default_partition} is not a partition: pipeline_parallel_degree "
                        f"is {cfg.pipeline_parallel_degree} (partitions 0 .. {cfg.pipeline_parallel_degree - 1})")


def virtual_round_problem(cfg: Config, microbatches: int | None = None) -> str | None:
    """Why the interleaved schedule over virtual stages cannot run ``microbatches`` (default: the
    config's) in rounds of ``active_microbatches``; None when it can. PyTorch's interleaved 1F1B
    cuts a schedule's M microbatches into max(1, M // pipeline_parallel_degree) equal rounds."""
    pp, virtual = cfg.pipeline_parallel_degree, cfg.pipeline_virtual_stages
    if pp == 1 or virtual == 1 or cfg.pipeline != "interleaved":
        return None
    m = microbatches or cfg.microbatches
    size = cfg.active_microbatches or m
    for count in sorted({min(size, m), m % size} - {0}):
        rounds = max(1, count // pp)
        if count % rounds:
            what = f"microbatches {m}" if count == m else \
                f"a schedule of {count} microbatches (microbatches {m} in rounds of active_microbatches {size})"
            return (f"pipeline_virtual_stages {virtual} with pipeline 'interleaved' at pipeline_parallel_degree {pp} "
                    f"runs {what} in {rounds} equal rounds, and {count} is not a multiple of {rounds}; use a "
                    f"multiple of {pp}")
    return None


def _check_virtual(cfg: Config, problems: list[str]) -> None:
    if cfg.pipeline_virtual_stages > 1 and cfg.pipeline_parallel_degree == 1:
        problems.append(f"pipeline_virtual_stages {cfg.pipeline_virtual_stages} needs pipeline_parallel_degree > 1")
    problem = virtual_round_problem(cfg)
    if problem:
        problems.append(problem)


def _unbuilt_virtual(cfg: Config) -> list[str]:
    if cfg.pipeline_virtual_stages > 1 and not cfg.auto_partition:
        return [f"pipeline_virtual_stages {cfg.pipeline_virtual_stages} with auto_partition false (partition marks "
                "name one stage per pipeline rank)"]
    return []


def unbuilt_combinations(cfg: Config, api: str | None = None) -> list[str]:
    """The dimensions ``cfg`` combines that do not compose here, each naming its keys (``api``:
    "v2" for a job started by ``transform``; both APIs compose the same dimensions today)."""
    found = []
    pp, ep, cp = cfg.pipeline_parallel_degree, cfg.expert_parallel_degree, cfg.context_parallel_degree
    if cfg.sequence_parallel and ep > 1 and cfg.tensor_parallel_degree > 1:
        found.append(f"sequence_parallel with expert_parallel_degree {ep} (the experts' gradients from each TP "
                     "rank's sequence shard are not summed over the TP ranks); use one of them")
    if cfg.expert_tensor_parallel and cfg.tensor_parallel_degree > 1:
        if pp > 1:
            found.append(f"expert_tensor_parallel with pipeline_parallel_degree {pp} (pipeline stages holding "
                         "experts split over tp are not built); use one of them")
        if cp > 1:
            found.append(f"expert_tensor_parallel with context_parallel_degree {cp} (experts split over tp would "
                         "average their gradients over expert replicas that leave out the context ranks); use "
                         "one of them")
    return found
