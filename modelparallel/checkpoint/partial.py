"""Partial checkpoints: save and load ``path/{tag}_partial/`` in phases that every rank agrees on.

Save: prepare (state dicts, staging directory) -> write (DCP model and optimizer parts, user
content) -> checksum (each rank hashes and fsyncs a share of the files) -> commit (rank 0 writes
the manifest, renames the directory into place, writes ``newest``, applies retention). Each
phase ends in an agreement (``errors.run_phase``), so a failure anywhere raises everywhere.

Load: verify (each rank checks a share of the files against the manifest) -> per part: compare
keys and shapes with the checkpoint -> DCP read into the live tensors.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import runtime
from ..pipeline.split import elsewhere
from . import commit, optim_part, parts
from .errors import run_phase, single_error
from .parts import LoadReport

FORMAT = "modelparallel-partial"
MODEL, OPTIMIZER = "model", "optimizer"
CONTIGUOUS = "contiguous"  # manifest "tensor_layout": tensors stored contiguous (fastread's direct path)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def describe(model, optimizer) -> dict[str, Any]:
    """What the manifest records about the saving job: architecture and layout."""
    cfg = runtime.current().config
    config = getattr(model.module, "config", None)
    return {
        "model_type": getattr(config, "model_type", None),
        "model_class": type(model.module).__name__,
        "optimizer_class": type(optimizer.optimizer).__name__ if optimizer is not None else None,
        "layout": {"world_size": cfg.world_size, "tensor_parallel_degree": cfg.tensor_parallel_degree,
                   "pipeline_parallel_degree": cfg.pipeline_parallel_degree,
                   "dp_degree": cfg.dp_degree, "placement_strategy": cfg.placement_strategy},
        "dtype": str(next(model.module.parameters()).dtype),
        "ties": parts.tied_keys(model.module),
        "torch_version": torch.__version__,
    }


def save(path: Path, tag: str, model, optimizer, user_content: Any, keep: int | None,
         trust_user_content: bool = False) -> Path:
    """Write ``path/{tag}_partial`` (a collective). Returns the committed directory.

    Rank 0 holds the directory's writer lock from before it cleans leftovers until the commit is
    checked, so another job saving into ``path`` fails instead of deleting this one's files."""
    rank, world = _rank_world()
    name = f"{tag}_partial"
    states: dict[str, Any] = {}
    lock = commit.DirectoryLock(path)
    content: dict[str, bytes] = {}

    everywhere = optim_part.group_names_everywhere(model.module, optimizer, runtime.current().group(
        runtime.PP_GROUP)) if optimizer is not None else None  # a collective of the pipeline group

    def prepare():  # returns only small payloads: every phase's result is sent to every rank
        states[MODEL] = parts.model_state(model.module)
        if optimizer is not None:
            states[OPTIMIZER] = optim_part.optimizer_state(model.module, optimizer, everywhere)
        if rank != 0:
            return None
        staged, content["bytes"] = parts.stage(path, name, lock, user_content, trust_user_content)
        return staged

    try:
        staging = path / run_phase("save (prepare)", prepare)[0]
        try:
            written = run_phase("save (write)", lambda: _write(states, staging, content.get("bytes"), rank))
            sums = run_phase("save (checksum)", lambda: _checksums(staging, rank, world))
            files = {k: v for s in sums for k, v in s.items()}
            lost = sorted({f for w in written for f in w} - set(files))
            manifest = {"format": FORMAT, "version": 1, "tag": tag, "tensor_layout": CONTIGUOUS,
                        "parts": sorted(states) + ["user_content"], "files": files,
                        "user_content_trusted": bool(trust_user_content), **describe(model, optimizer)}
            run_phase("save (commit)", lambda: _commit(path, staging, name, manifest, keep, lost)
                      if rank == 0 else None)
        except Exception:
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        lock.release()
    return path / name


def _write(states: dict, staging: Path, content: bytes | None, rank: int) -> list[str]:
    """Write this rank's share; returns the files it wrote (checked again at commit)."""
    for part, state in states.items():
        parts.write_part(state, staging / part)
    if rank == 0:
        parts.write_bytes(staging / parts.USER_CONTENT, content)
    mine = [f"{part}/{p.name}" for part in states for p in (staging / part).glob(f"__{rank}_*.distcp")]
    return mine + ([f"{part}/.metadata" for part in states] + [parts.USER_CONTENT] if rank == 0 else [])


def _checksums(staging: Path, rank: int, world: int) -> dict[str, dict]:
    """This rank's share of the files, hashed and fsynced (every rank reads a different share)."""
    sizes = {f: (staging / f).stat().st_size for f in commit.data_files(staging)}
    return {f: commit.file_checksum(staging / f, fsync=True) for f in commit.share(sizes, rank, world)}


def _commit(path: Path, staging: Path, name: str, manifest: dict, keep: int | None, lost: list[str]) -> None:
    """Rank 0: check that every file any rank wrote was checksummed, write the manifest, commit,
    check the committed directory holds exactly the manifest's files, point ``newest``."""
    if lost:
        raise OSError(f"files written by this save disappeared from {staging} before commit: {lost}")
    manifest["saved_at_ns"] = time.time_ns()
    commit.write_manifest(staging, manifest)
    commit.commit_dir(staging, path / name)
    commit.check_committed(path / name, manifest)
    commit.write_newest(path, name)
    if keep is not None:
        commit.apply_retention(path, keep, protect=name)


def verify(directory: Path, manifest: dict, prefixes: tuple[str, ...]) -> None:
    """Check every file of the parts in ``prefixes`` against the manifest, shared among ranks;
    raise on every rank, naming every bad file, if any is missing, truncated or corrupted, or
    if the directory holds a file the manifest does not list (rank 0 looks)."""
    rank, world = _rank_world()
    sizes = {f: e["size"] for f, e in manifest["files"].items() if f.startswith(prefixes)}
    mine = commit.share(sizes, rank, world)
    problems = run_phase("load (verify)", lambda: [
        msg for f in mine if (msg := commit.verify_file(directory, f, manifest["files"][f]))]
        + (commit.unlisted_files(directory, manifest) if rank == 0 else []))
    single_error("load (verify): files do not match the manifest", [m for p in problems for m in p])


def check_part(directory: Path, part: str, state: dict[str, Any], strict: bool,
               elsewhere: set[str] = frozenset()) -> LoadReport:
    """Compare ``state`` with the saved part; raise on every rank (strict) if it does not fit.
    ``elsewhere``: saved keys other pipeline stages load."""
    def check():
        report = parts.compare(state, directory / part, elsewhere)
        problems = report.problems(part) if strict else []
        if problems:
            raise ValueError("checkpoint does not fit (strict=True):\n  - " + "\n  - ".join(problems))
        return report

    return run_phase(f"load ({part}: keys)", check)[_rank_world()[0]]


def read_checked(directory: Path, manifest: dict, part: str, state: dict[str, Any], report: LoadReport) -> None:
    """DCP read of what ``check_part`` accepted into ``state``'s tensors (a collective)."""
    contiguous = manifest.get("tensor_layout") == CONTIGUOUS
    run_phase(f"load ({part}: read)",
              lambda: parts.read_part(state, directory / part, parts.loadable(state, report), contiguous))


def check_model(directory: Path, manifest: dict, model, strict: bool) -> LoadReport:
    """Everything about the model part that can fail, checked before any weight changes."""
    run_phase("load (model: architecture)", lambda: check_architecture(manifest, model))
    return check_part(directory, MODEL, parts.model_state(model.module), strict, elsewhere(model.module))


def load_model(directory: Path, manifest: dict, model, report: LoadReport) -> LoadReport:
    read_checked(directory, manifest, MODEL, parts.model_state(model.module), report)
    return report


def check_optimizer_names(directory: Path, manifest: dict, model, strict: bool) -> None:
    """Before any weight is loaded, with no optimizer yet: the optimizer part names this model's
    parameters at their shapes. (A checkpoint without an optimizer part is refused when an
    optimizer is created: a job may never create one.)"""
    if OPTIMIZER not in manifest["parts"]:
        return
    problems = optim_part.check_names_against_model(model.module, directory / OPTIMIZER) if strict else []
    if problems:
        raise ValueError("checkpoint does not fit (strict=True):\n  - " + "\n  - ".join(problems))


def plan_optimizer(directory: Path, manifest: dict, model, optimizer, strict: bool):
    """The optimizer part's targets and report (its small ``param_groups`` entries are read
    now), or raise on every rank if it does not fit (a collective; no optimizer state changes)."""
    def present():
        if OPTIMIZER not in manifest["parts"]:
            raise ValueError(f"{directory} holds no optimizer state (saved without an optimizer); "
                             "resume with load_optimizer=False")

    run_phase("load (optimizer: present)", present)
    contiguous = manifest.get("tensor_layout") == CONTIGUOUS
    part = directory / OPTIMIZER
    found: dict[str, Any] = {}  # tensors stay local: a phase's result is sent to every rank
    run_phase("load (optimizer: plan)", lambda: found.update(plan=optim_part.plan_load(model.module, optimizer, part)))
    planned = found["plan"]
    run_phase("load (optimizer: groups)",
              lambda: parts.read_part(planned.nested, part, planned.group_keys, contiguous))

    def check():
        report = planned.report()
        problems = report.problems(OPTIMIZER) if strict else []
        if problems:
            raise ValueError("checkpoint does not fit (strict=True):\n  - " + "\n  - ".join(problems))
        return report

    return planned, run_phase("load (optimizer: keys)", check)[_rank_world()[0]]


def load_optimizer(directory: Path, manifest: dict, model, optimizer, planned) -> LoadReport:
    """Read the planned optimizer part into its new tensors, then replace the optimizer's state."""
    plan, report = planned
    contiguous = manifest.get("tensor_layout") == CONTIGUOUS
    keys = set(parts.flatten(plan.nested)) - plan.group_keys
    run_phase("load (optimizer: read)", lambda: parts.read_part(plan.nested, directory / OPTIMIZER, keys, contiguous))
    run_phase("load (optimizer: apply)", lambda: optim_part.apply_optimizer_state(model.module, optimizer, plan.nested))
    return report


def check_architecture(manifest: dict, model) -> None:
    """Refuse a checkpoint of another architecture before reading any tensor."""
    config = getattr(model.module, "config", None)
    mine, saved = getattr(config, "model_type", None), manifest.get("model_type")
    if saved != mine:
        raise ValueError(f"the checkpoint holds a {saved!r} model ({manifest.get('model_class')}); "
                         f"this model is {mine!r} ({type(model.module).__name__})")
