"""Partial checkpoints: save ``path/{tag}_partial/`` in phases that every rank agrees on.

Save: prepare (state dicts, staging directory) -> write (DCP model and optimizer parts, user
content) -> checksum (each rank hashes and fsyncs a share of the files) -> commit (rank 0 writes
the manifest, renames the directory into place, writes ``newest``, applies retention). Each
phase ends in an agreement (``errors.run_phase``), so a failure anywhere raises everywhere.
Loading is ``partial_load``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ... import runtime
from ...tp.layout import local_part
from ..format import model_config
from ..load import optim_part, parts
from ..load.parts import CONTIGUOUS
from ..safety import commit
from ..safety.errors import run_phase

FORMAT = "modelparallel-partial"
MODEL, OPTIMIZER = "model", "optimizer"


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
        "config": model_config.structural(config),
        "torch_version": torch.__version__,
    }


def save(path: Path, tag: str, model, optimizer, user_content: Any, keep: int | None,
         trust_user_content: bool = False, saver=None, background_staging: bool = True) -> Path:
    """Write ``path/{tag}_partial`` (a collective). Returns the committed directory (with a
    ``saver``: the directory it will be committed as, once the background save finishes).

    Rank 0 takes the directory's writer lock for the job (``lock.job_lock``) before it cleans
    leftovers, so another job saving into ``path`` fails instead of deleting this one's files.
    Retention runs after the commit; a checkpoint it cannot delete is logged, not raised: the
    save itself succeeded. With an ``async_save.AsyncSaver``, the states are copied into its
    staging buffers here and the write, checksum and commit phases run in its background thread
    on its own process group; with ``background_staging``, the tensors only the optimizer's step
    changes are copied by that thread (``async_save.Stager.stage``'s ``defer``), and the
    optimizer's step waits for it."""
    rank, world = _rank_world()
    name = f"{tag}_partial"
    states: dict[str, Any] = {}
    content: dict[str, bytes] = {}
    step_tensors = _step_tensors(optimizer) if saver is not None and background_staging and optimizer is not None \
        else None
    defer = step_only(step_tensors) if step_tensors is not None else None
    if defer is not None:  # their CRC32s, read while the call does the rest (see async_save.Stager)
        saver.stager.fingerprint_early(step_tensors)

    everywhere = optim_part.group_names_everywhere(model.module, optimizer, runtime.current().group(
        runtime.PP_GROUP)) if optimizer is not None else None  # a collective of the pipeline group

    def prepare():  # returns only small payloads: every phase's result is sent to every rank
        states[MODEL] = parts.model_state(model.module)
        if optimizer is not None:
            states[OPTIMIZER] = optim_part.optimizer_state(model.module, optimizer, everywhere)
        if rank != 0:
            return None
        staged, content["bytes"] = parts.stage(path, name, runtime.current().held_locks, user_content, trust_user_content)
        return staged

    staging = path / run_phase("save (prepare)", prepare)[0]
    manifest = {"format": FORMAT, "version": 1, "tag": tag, "tensor_layout": CONTIGUOUS,
                "parts": sorted(states) + ["user_content"], "user_content_trusted": bool(trust_user_content),
                **describe(model, optimizer)}
    phases = _Phases(path, staging, name, manifest, content.get("bytes"), keep,
                     runtime.current().config.checkpoint_drop_behind)
    if saver is None:
        phases.run(states)
        return path / name
    group = saver.process_group()
    found: dict[str, Any] = {}
    try:
        run_phase("save (stage)", lambda: found.update(states=saver.stager.stage(states, defer)))
    except Exception:
        saver.stager.abandon()
        phases.discard()
        raise
    finally:
        saver.stager.fingerprint_early(None)
    before = saver.stage_deferred if defer is not None else None
    saver.submit(tag, lambda: phases.run(found.pop("states"), group, before),
                 hold=(optimizer.optimizer,) if defer is not None else ())
    return path / name


@torch.no_grad()  # a DTensor's to_local() is then its local tensor, not an autograd view (1,300 of them)
def _step_tensors(optimizer) -> list[torch.Tensor]:
    """The local tensors only ``optimizer``'s step changes: its parameters, slots and fp32
    masters (scalars such as step counters excluded)."""
    tensors = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    tensors += [v for slots in optimizer.optimizer.state.values() for v in slots.values() if isinstance(v, torch.Tensor)]
    tensors += [m for _, m in optimizer.master_weights.pairs]
    return [local_part(t) for t in tensors if t.dim() > 0 and t.numel() > 0]


def step_only(step_tensors: list[torch.Tensor]) -> Callable[[torch.Tensor], bool]:
    """Which local tensors only the optimizer's step changes (its ``_step_tensors``): those may
    be staged in the background while the step waits for it. Scalars (step counters) are not:
    they are copied at once."""
    ptrs = {t.data_ptr() for t in step_tensors}
    return lambda t: t.dim() > 0 and t.numel() > 0 and t.data_ptr() in ptrs


class _Phases:
    """The phases of a save after ``prepare``: write, checksum, commit (on ``group``)."""

    def __init__(self, path: Path, staging: Path, name: str, manifest: dict, content: bytes | None,
                 keep: int | None, drop_behind: bool = True):
        self.path, self.staging, self.name, self.manifest = path, staging, name, manifest
        self.content, self.keep, self.drop_behind = content, keep, drop_behind

    def discard(self) -> None:
        if _rank_world()[0] == 0:
            shutil.rmtree(self.staging, ignore_errors=True)

    def run(self, states: dict, group=None, stage: Callable[[], None] | None = None) -> None:
        """``stage``: the background part of staging, run (and agreed on) first."""
        rank, world = _rank_world()
        try:
            if stage is not None:
                run_phase("save (stage)", stage, group)
            known: dict[str, dict] = {}
            written = run_phase("save (write)", lambda: _write(states, self.staging, self.content, rank, known, group,
                                                               self.drop_behind), group)
            sums = run_phase("save (checksum)", lambda: _checksums(self.staging, rank, world, known), group)
            files = {k: v for s in sums for k, v in s.items()}
            lost = sorted({f for w in written for f in w} - set(files))
            manifest = {**self.manifest, "files": files}
            run_phase("save (commit)", lambda: _commit(self.path, self.staging, self.name, manifest, lost, self.keep)
                      if rank == 0 else None, group)
        except Exception:
            self.discard()
            raise


def _write(states: dict, staging: Path, content: bytes | None, rank: int, sums: dict, group=None,
           drop_behind: bool = True) -> list[str]:
    """Write this rank's share; returns the files it wrote (checked again at commit) and puts
    the checksums computed while writing into ``sums``."""
    for part, state in states.items():
        sums.update({f"{part}/{f}": v for f, v in parts.write_part(state, staging / part, group, drop_behind).items()})
    if rank == 0:
        parts.write_bytes(staging / parts.USER_CONTENT, content)
    mine = [f"{part}/{p.name}" for part in states for p in (staging / part).glob(f"__{rank}_*.distcp")]
    return mine + ([f"{part}/.metadata" for part in states] + [parts.USER_CONTENT] if rank == 0 else [])


def _checksums(staging: Path, rank: int, world: int, known: dict[str, dict]) -> dict[str, dict]:
    """This rank's share of the files, fsynced and checksummed (every rank takes a different
    share: the files it wrote itself, whose checksums ``known`` holds from the write, are only
    fsynced; the others are read)."""
    sizes = {f: (staging / f).stat().st_size for f in commit.data_files(staging)}
    return {f: commit.synced_checksum(staging / f, known.get(f)) for f in commit.share(sizes, rank, world)}


def _commit(path: Path, staging: Path, name: str, manifest: dict, lost: list[str], keep: int | None) -> None:
    """Rank 0: check that every file any rank wrote was checksummed, write the manifest, commit,
    check the committed directory holds exactly the manifest's files, point ``newest``, apply
    retention (``commit.retain``: what it cannot delete is logged, the save succeeded)."""
    if lost:
        raise OSError(f"files written by this save disappeared from {staging} before commit: {lost}")
    manifest["saved_at_ns"] = commit.saved_at(path)
    commit.write_manifest(staging, manifest)
    commit.commit_dir(staging, path / name)
    commit.check_committed(path / name, manifest)
    commit.write_newest(path, name)
    if keep is not None:
        commit.retain(path, keep, protect=name)


def check_architecture(manifest: dict, model) -> None:
    """Refuse a checkpoint of another architecture before reading any tensor."""
    config = getattr(model.module, "config", None)
    mine, saved = getattr(config, "model_type", None), manifest.get("model_type")
    if saved != mine:
        raise ValueError(f"the checkpoint holds a {saved!r} model ({manifest.get('model_class')}); "
                         f"this model is {mine!r} ({type(model.module).__name__})")
