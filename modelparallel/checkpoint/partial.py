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
from . import commit, parts
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
                   "dp_degree": cfg.dp_degree, "placement_strategy": cfg.placement_strategy},
        "dtype": str(next(model.module.parameters()).dtype),
        "ties": parts.tied_keys(model.module),
        "torch_version": torch.__version__,
    }


def save(path: Path, tag: str, model, optimizer, user_content: Any, keep: int | None) -> Path:
    """Write ``path/{tag}_partial`` (a collective). Returns the committed directory."""
    rank, world = _rank_world()
    name = f"{tag}_partial"
    states: dict[str, Any] = {}

    def prepare():  # returns only small payloads: every phase's result is sent to every rank
        states[MODEL] = parts.model_state(model.module)
        if optimizer is not None:
            states[OPTIMIZER] = parts.optimizer_state(model.module, optimizer)
        if rank != 0:
            return None
        return commit.new_staging(path, name).name

    staging = path / run_phase("save (prepare)", prepare)[0]
    try:
        run_phase("save (write)", lambda: _write(states, staging, user_content, rank))
        sums = run_phase("save (checksum)", lambda: _checksums(staging, rank, world))
        manifest = {"format": FORMAT, "version": 1, "tag": tag, "tensor_layout": CONTIGUOUS, "parts": sorted(states) + ["user_content"],
                    "files": {k: v for s in sums for k, v in s.items()}, **describe(model, optimizer)}
        run_phase("save (commit)", lambda: _commit(path, staging, name, manifest, keep) if rank == 0 else None)
    except Exception:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return path / name


def _write(states: dict, staging: Path, user_content: Any, rank: int) -> None:
    for part, state in states.items():
        parts.write_part(state, staging / part)
    if rank == 0:
        parts.write_user_content(user_content, staging)


def _checksums(staging: Path, rank: int, world: int) -> dict[str, dict]:
    """This rank's share of the files, hashed and fsynced (every rank reads a different share)."""
    sizes = {f: (staging / f).stat().st_size for f in commit.data_files(staging)}
    return {f: commit.file_checksum(staging / f, fsync=True) for f in commit.share(sizes, rank, world)}


def _commit(path: Path, staging: Path, name: str, manifest: dict, keep: int | None) -> None:
    manifest["saved_at_ns"] = time.time_ns()
    commit.write_manifest(staging, manifest)
    commit.commit_dir(staging, path / name)
    commit.write_newest(path, name)
    if keep is not None:
        commit.apply_retention(path, keep, protect=name)


def verify(directory: Path, manifest: dict, prefixes: tuple[str, ...]) -> None:
    """Check every file of the parts in ``prefixes`` against the manifest, shared among ranks;
    raise on every rank, naming every bad file, if any is missing, truncated or corrupted."""
    rank, world = _rank_world()
    sizes = {f: e["size"] for f, e in manifest["files"].items() if f.startswith(prefixes)}
    mine = commit.share(sizes, rank, world)
    problems = run_phase("load (verify)", lambda: [
        msg for f in mine if (msg := commit.verify_file(directory, f, manifest["files"][f]))])
    single_error("load (verify): files do not match the manifest", [m for p in problems for m in p])


def load_part(directory: Path, manifest: dict, part: str, state: dict[str, Any], strict: bool) -> LoadReport:
    """Compare ``state`` with the saved part, raise (strict) or skip what does not fit, then read."""
    def check():
        report = parts.compare(state, directory / part)
        problems = report.problems(part) if strict else []
        if problems:
            raise ValueError("checkpoint does not fit (strict=True):\n  - " + "\n  - ".join(problems))
        return report

    report = run_phase(f"load ({part}: keys)", check)[_rank_world()[0]]
    contiguous = manifest.get("tensor_layout") == CONTIGUOUS
    run_phase(f"load ({part}: read)",
              lambda: parts.read_part(state, directory / part, parts.loadable(state, report), contiguous))
    return report


def load_model(directory: Path, manifest: dict, model, strict: bool) -> LoadReport:
    check_architecture(manifest, model)
    return load_part(directory, manifest, MODEL, parts.model_state(model.module), strict)


def load_optimizer(directory: Path, manifest: dict, model, optimizer, strict: bool) -> LoadReport:
    if OPTIMIZER not in manifest["parts"]:
        raise ValueError(f"{directory} holds no optimizer state (saved without an optimizer); "
                         "resume with load_optimizer=False")
    state: dict[str, Any] = {}
    run_phase("load (optimizer: init)",
              lambda: state.update(parts.optimizer_state(model.module, optimizer, directory / OPTIMIZER)))
    report = load_part(directory, manifest, OPTIMIZER, state, strict)
    run_phase("load (optimizer: apply)", lambda: parts.apply_optimizer_state(model.module, optimizer, state))
    return report


def check_architecture(manifest: dict, model) -> None:
    """Refuse a checkpoint of another architecture before reading any tensor."""
    config = getattr(model.module, "config", None)
    mine, saved = getattr(config, "model_type", None), manifest.get("model_type")
    if saved != mine:
        raise ValueError(f"the checkpoint holds a {saved!r} model ({manifest.get('model_class')}); "
                         f"this model is {mine!r} ({type(model.module).__name__})")
