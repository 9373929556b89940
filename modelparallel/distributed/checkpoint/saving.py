"""A DCP save cut in two: the collective planning and staging now, the writing later.

DCP's ``save`` runs four steps: every rank plans its writes, the coordinator merges the plans
(and the metadata), every rank writes its files, the coordinator writes ``.metadata`` once all
ranks are done. DCP's own ``async_save`` runs the whole of it in a background thread, collectives
included, on the caller's process group; SageMaker v2 scripts pass the process group training
uses too (the FSDP or replication group), and two threads issuing collectives on one group can
interleave differently on different ranks. So ``start`` runs the planning collectives in the
caller's thread, snapshots every tensor the plan writes into host buffers (later training steps
cannot change what is saved), and hands only the file writing to a background thread;
``finish`` (a collective over the same group, again in the caller's thread) waits for it and lets
the coordinator write the metadata. A failure on any rank, in any step, is raised on every rank
(a staging failure by ``finish``: it fails that rank's write).

The background writing and the host buffers are the checkpoint package's own
(``checkpoint.async_save``: one ``AsyncSaver`` per queue, its ``Stager`` holding the buffers).
With ``background_staging``, the tensors only an optimizer step changes
(``staging.deferrable``) are copied by the background thread before it writes, and every
optimizer's next ``step`` waits for that copy; the call copies the rest.

Repeated saves of the same structure reuse their plan (``PlanCache``): each rank plans locally
as usual and compares its plan with the one it sent last time; if every rank's is unchanged
(one small collective, which also carries planning errors), the last global plan and metadata
are reused and the plan gather / global planning / scatter are skipped.

Built from DCP's own pieces (``DefaultSavePlanner``, the checkpoint package's
``CheckpointWriter``...): the files are the ones ``torch.distributed.checkpoint.save`` writes,
loadable with ``load``. They are written into a hidden staging directory that the coordinator
commits as ``checkpoint_id`` by an atomic rename once every rank's files are fsynced and
checksummed (``directory``): a checkpoint already there stays whole and loadable until then.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, SavePlanner, StorageWriter

from ... import devices
from ...checkpoint.background.async_save import AsyncSaver, Job
from ...checkpoint.background.deferred import Early
from . import directory
from .group_blocks import for_group
from .outcome import (CheckpointLoadError, CheckpointSaveError, Group, collective_outcome, group_of,  # noqa: F401
                      check_coordinators)
from .staging import StagedPlanner, deferrable, stage
from .state_dict_utils import check_local_group, check_objects, check_plans_agree


@dataclass
class PlanCache:
    """The last plan of each (group, coordinator, writer type): this rank's local plan (DCP's
    plans are dataclasses: compared field by field), its final plan, and (on the coordinator)
    the metadata."""

    entries: dict = field(default_factory=dict)
    hits: int = 0
    """Saves that reused a plan."""

    @staticmethod
    def key(group: Group, writer: StorageWriter) -> tuple:
        return tuple(group.members), group.coordinator, type(writer).__qualname__


def _agree_on_plan(group: Group, error: BaseException | None, unchanged: bool) -> bool:
    """Whether every rank of ``group`` has its last plan unchanged (one small all-reduce); an
    error on any rank is raised on every rank, with every rank's message."""
    flags = torch.tensor([int(error is not None), int(not unchanged)], dtype=torch.int32,
                         device=devices.for_group(group.pg))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.pg)
    if flags[0]:
        collective_outcome(group, error, "checkpoint save (planning)")
    return not flags[1]


@dataclass
class PendingSave:
    """A save whose files are being written in the background."""

    path: str
    group: Group
    writer: StorageWriter
    metadata: object
    job: Job
    extra_files: dict = field(default_factory=dict)
    """name -> bytes the coordinator writes next to the metadata (before it)."""
    staging: Path | None = None
    """The hidden directory the files are written into, committed as ``path``."""


def _plan(state_dict, writer: StorageWriter, planner: SavePlanner, group: Group, cache: PlanCache | None):
    """DCP's planning steps as collectives over ``group``: (this rank's final plan, metadata on
    the coordinator). With a ``cache``, a plan every rank already sent last time is reused."""
    rank_in_group = group.members.index(dist.get_rank())
    error, local = None, None
    key = PlanCache.key(group, writer) if cache is not None else None
    try:
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(),
                               is_coordinator=group.is_coordinator)
        writer.set_up_storage_writer(group.is_coordinator, rank=rank_in_group, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        error = e
    last = cache.entries.get(key) if cache is not None else None
    if _agree_on_plan(group, error, last is not None and error is None and last[0] == local):
        cache.hits += 1
        _, final, metadata = last
        return planner.finish_plan(final), copy.copy(metadata)
    plan, metadata = _global_plan(planner, writer, group, local)
    if cache is not None:
        cache.entries[key] = (local, plan, metadata)
        metadata = copy.copy(metadata)
    return plan, metadata


def _global_plan(planner: SavePlanner, writer: StorageWriter, group: Group, local):
    """The coordinator merges every rank's plan; each rank gets its final plan back."""
    metadata = None
    plans: list = [None] * len(group.members) if group.is_coordinator else None
    dist.gather_object(local, plans, dst=group.coordinator, group=group.pg)
    scatter: list = [None] * len(group.members)
    if group.is_coordinator:
        try:
            check_plans_agree(plans, group.members)
            plans, metadata = planner.create_global_plan(plans)
            scatter = writer.prepare_global_plan(plans)
        except Exception as e:  # noqa: BLE001 - sent to every rank below
            scatter = [e] * len(group.members)
    mine: list = [None]
    dist.scatter_object_list(mine, scatter if group.is_coordinator else None, src=group.coordinator, group=group.pg)
    if isinstance(mine[0], Exception):
        raise CheckpointSaveError(f"checkpoint save (global plan) failed on the coordinator: {mine[0]}")
    return planner.finish_plan(mine[0]), metadata


def _prepare(state_dict, writer: StorageWriter, group: Group, busy) -> Path:
    """Before anything is written (a collective): a local state dict only over ranks holding
    the same tensors; the coordinator checks that ``checkpoint_id`` may be replaced, removes what
    interrupted saves of it left (unless a save of it is still pending: ``busy``, path -> whether
    in this queue) and makes the staging directory, which every rank's writer then writes into.
    A save of a path another queue has pending is refused: its staging directory would be taken
    for a leftover, and the older save would commit over this one. Returns that directory."""
    final = Path(writer.path)
    error, nonce = None, None
    try:
        check_local_group(state_dict, group.members)
        check_objects(state_dict)
        if group.is_coordinator:
            directory.check_replaceable(final)
            directory.check_not_pending(final, busy)
            if str(final) not in busy:
                directory.remove_leftovers(final)
            nonce = directory.new_staging(final)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        error = e
    try:
        agreed = _agree_on_staging(group, error, nonce, f"checkpoint save to {final}")
    except CheckpointSaveError:
        if nonce is not None:  # this rank took itself for the coordinator
            directory.discard(directory.staging_path(final, nonce))
        raise
    staging = directory.staging_path(final, agreed)
    writer.reset(staging)
    return staging


def _agree_on_staging(group: Group, error: BaseException | None, nonce: int | None, what: str) -> int:
    """The coordinator's staging nonce, on every rank (one all-reduce, a quarter of the time of
    gathering objects: each asynchronous save's call pays it); an error on any rank, or ranks
    naming different coordinators, is raised on every rank (then gathering every rank's word)."""
    coordinator = group.coordinator
    flags = torch.tensor([int(error is not None), nonce or 0, coordinator, -coordinator], dtype=torch.int64,
                         device=devices.for_group(group.pg))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.pg)
    if flags[0]:
        collective_outcome(group, error, f"{what} (prepare)")
    if flags[2] != -flags[3]:
        coordinators: list = [None] * len(group.members)
        dist.all_gather_object(coordinators, coordinator, group=group.pg)
        check_coordinators(group, coordinators, what)
    return int(flags[1])


@torch.no_grad()  # nothing here is differentiated; a DTensor's to_local() is then its local tensor, no autograd view
def start(state_dict, writer: StorageWriter, planner: SavePlanner | None, group: Group, saver: AsyncSaver,
          cache: PlanCache, staging: str = "background", busy=None) -> PendingSave:
    """Plan (collectively; a default planner's plan is cached), stage into ``saver``'s buffers
    and start writing ``state_dict`` in its thread. ``staging``: ``"background"`` (what only an
    optimizer step changes is copied by the writer thread first, the optimizers' next step
    waiting for it), ``"call"`` (everything copied here), ``"none"`` (no copy: for a save
    finished before training goes on). A staging failure fails this rank's write (raised on
    every rank by ``finish``). ``busy``: checkpoint paths with a save still pending, each with
    whether it is pending in the calling queue (finalized in order after this one) or another."""
    custom = planner is not None
    planner = planner or DefaultSavePlanner()
    final = Path(writer.path)  # before _prepare points the writer at the staging directory
    memory: list | None = [] if Early.pays() else None  # their CRC32s read while the call plans (see Stager)
    deferred_keys = deferrable(state_dict, memory) if staging == "background" else {}
    saver.stager.fingerprint_early(memory)
    try:
        staged, error, plan, metadata, hidden = _plan_and_stage(state_dict, writer, planner, custom, group, saver,
                                                                cache, staging, busy, deferred_keys)
    finally:
        saver.stager.fingerprint_early(None)
    staged_planner = StagedPlanner(staged)
    deferred = bool(saver.stager.deferred)

    def write():
        if error is not None:
            raise error
        if deferred:
            saver.stage_deferred()
        try:
            result = writer.write_data(plan, staged_planner)
            result.wait()
            return result.value()
        except Exception as e:
            if getattr(writer, "errors", None):  # the failed write itself, naming its file
                raise writer.errors[0] from e
            raise

    job = saver.submit(str(final), write, at_exit=False, hold_every_optimizer=deferred)
    return PendingSave(str(final), group, writer, metadata, job, staging=hidden)


def _plan_and_stage(state_dict, writer, planner, custom: bool, group: Group, saver: AsyncSaver, cache: PlanCache,
                    staging: str, busy, deferred_keys: dict) -> tuple:
    """``start``'s collective part: (staged items, staging error, plan, metadata, hidden directory)."""
    final = Path(writer.path)
    with for_group(state_dict, group.pg):
        hidden = _prepare(state_dict, writer, group, dict(busy or {}))
        try:
            plan, metadata = _plan(state_dict, writer, planner, group, None if custom else cache)
        except BaseException:
            _abandon(group, writer, hidden, final)
            raise
        error, staged = None, None
        try:
            staged = stage(planner, plan, None if staging == "none" else saver.stager, deferred_keys)
        except Exception as e:  # noqa: BLE001 - raised by this rank's write, so by finish() on every rank
            error = e
            saver.stager.abandon()
    return staged, error, plan, metadata, hidden


def _abandon(group: Group, writer: StorageWriter, staging: Path, final: Path) -> None:
    """A save that will not commit: its staging directory removed (by the coordinator, once
    every rank stopped writing), the writer pointed at the checkpoint again."""
    if group.is_coordinator:
        directory.discard(staging)
    writer.reset(final)


def _my_sums(pending: PendingSave, results) -> dict[str, dict]:
    """This rank's files, fsynced and checksummed (those ``CheckpointWriter`` wrote: checksummed
    as they were written, only fsynced now)."""
    known = {Path(p).name: v for p, v in getattr(pending.writer, "sums", {}).items()
             if Path(p).parent == pending.staging}
    names = {r.storage_data.relative_path for r in results or ()} | set(known)
    return directory.fsynced_sums(pending.staging, names, known)


def finish(pending: PendingSave) -> None:
    """Wait for this rank's files and checksum them, then (collectively) let the coordinator
    write the metadata and commit the checkpoint."""
    pending.job.join()
    error, results, group, final = pending.job.error, pending.job.result, pending.group, Path(pending.path)
    sums = None
    try:
        if error is None:
            try:
                sums = _my_sums(pending, results)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it
                error = e
        collective_outcome(group, error, f"checkpoint save to {final} (writing)")
        gathered: list = [None] * len(group.members) if group.is_coordinator else None
        dist.gather_object((results, sums), gathered, dst=group.coordinator, group=group.pg)
        error = None
        if group.is_coordinator:
            try:
                _commit(pending, gathered)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it
                error = e
        collective_outcome(group, error, f"checkpoint save to {final} (commit)")
    except BaseException:
        _abandon(group, pending.writer, pending.staging, final)
        raise
    pending.writer.reset(final)
    if hasattr(pending.writer, "committed"):  # DistributedFileSystemWriter's post-write hooks
        pending.writer.committed()


def _commit(pending: PendingSave, gathered: list) -> None:
    """The coordinator: layout record and ``.metadata`` written into the staging directory,
    which is then committed whole."""
    for name, data in pending.extra_files.items():
        with open(pending.staging / name, "wb") as f:
            f.write(data)
    pending.writer.finish(metadata=directory.marked(pending.metadata), results=[r for r, _ in gathered])
    directory.commit_checkpoint(pending.staging, Path(pending.path), {k: v for _, s in gathered for k, v in s.items()})
