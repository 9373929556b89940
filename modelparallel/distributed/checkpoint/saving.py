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

Repeated saves of the same structure reuse their plan (``planning``): each rank compares a
fingerprint of its flattened state dict with the last save's; if every rank's is unchanged (a
flag in the prepare step's all-reduce, the call's one collective), the last global plan and
metadata are reused and the writer thread checks, before writing, that the local plan this save
would have sent is the one they were made from.

Built from DCP's own pieces (``DefaultSavePlanner``, the checkpoint package's
``CheckpointWriter``...): the files are the ones ``torch.distributed.checkpoint.save`` writes,
loadable with ``load``. They are written into a hidden staging directory that the coordinator
commits as ``checkpoint_id`` by an atomic rename once every rank's files are fsynced and
checksummed (``directory``): a checkpoint already there stays whole and loadable until then.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import SavePlanner, StorageWriter

from ... import devices
from ...checkpoint.background.async_save import AsyncSaver, Job
from ...checkpoint.background.deferred import Early
from . import directory
from .group_blocks import for_group
from .outcome import (CheckpointLoadError, CheckpointSaveError, Group, collective_outcome, group_of,  # noqa: F401
                      check_coordinators)
from .planning import Planner, Planning, PlanCache
from .staging import StagedPlanner, deferrable, stage
from .state_dict_utils import check_local_group, check_objects


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
    forget_plan: Callable[[], None] | None = None
    """Drops the plan this save reused (a failed save may have failed its plan's check)."""


def _prepare(state_dict, writer: StorageWriter, group: Group, busy, planning: Planning) -> tuple[Path, bool]:
    """Before anything is written (one all-reduce, which also carries the planning's state):
    a local state dict only over ranks holding the same tensors; the coordinator checks that
    ``checkpoint_id`` may be replaced, removes what interrupted saves of it left (unless a save
    of it is still pending: ``busy``, path -> whether in this queue) and makes the staging
    directory, which every rank's writer then writes into. A save of a path another queue has
    pending is refused: its staging directory would be taken for a leftover, and the older save
    would commit over this one. Returns that directory and whether every rank reuses its plan."""
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
        agreed, planning_failed, reuse = _agree_on_staging(group, error, nonce, f"checkpoint save to {final}", planning)
    except CheckpointSaveError:
        if nonce is not None:  # this rank took itself for the coordinator
            directory.discard(directory.staging_path(final, nonce))
        raise
    staging = directory.staging_path(final, agreed)
    writer.reset(staging)
    if planning_failed:
        _abandon(group, writer, staging, final)
        collective_outcome(group, planning.error, "checkpoint save (planning)")
    return staging, reuse


def _agree_on_staging(group: Group, error: BaseException | None, nonce: int | None, what: str,
                      planning: Planning) -> tuple[int, bool, bool]:
    """(the coordinator's staging nonce, whether the planning failed on some rank, whether every
    rank reuses its plan), on every rank: one all-reduce, a quarter of the time of gathering
    objects (each asynchronous save's call pays it); an error on any rank, or ranks naming
    different coordinators, is raised on every rank (then gathering every rank's word)."""
    coordinator = group.coordinator
    flags = torch.tensor([int(error is not None), nonce or 0, coordinator, -coordinator,
                          int(planning.error is not None), int(planning.entry is None)], dtype=torch.int64,
                         device=devices.for_group(group.pg))
    if dist.get_world_size(group.pg) > 1:  # (a group of one: its own word is the outcome)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.pg)
    if flags[0]:
        collective_outcome(group, error, f"{what} (prepare)")
    if flags[2] != -flags[3]:
        coordinators: list = [None] * len(group.members)
        dist.all_gather_object(coordinators, coordinator, group=group.pg)
        check_coordinators(group, coordinators, what)
    return int(flags[1]), bool(flags[4]), not flags[5]


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
    planner = planner or Planner()
    final = Path(writer.path)  # before _prepare points the writer at the staging directory
    memory: list | None = [] if Early.pays() else None  # their CRC32s read while the call plans (see Stager)
    deferred_keys = deferrable(state_dict, memory) if staging == "background" else {}
    saver.stager.fingerprint_early(memory)
    try:
        planned, staged, error = _plan_and_stage(state_dict, writer, planner, None if custom else cache, group,
                                                 saver, staging, busy, deferred_keys)
    finally:
        saver.stager.fingerprint_early(None)
    plan, metadata, check, hidden, forget = planned
    staged_planner = StagedPlanner(staged)
    deferred = bool(saver.stager.deferred)

    def write():
        if error is not None:
            raise error
        if deferred:
            saver.stage_deferred()
        if check is not None:  # a reused plan: this save's own local plan must be the one it was made from
            check()
        try:
            result = writer.write_data(plan, staged_planner)
            result.wait()
            return result.value()
        except Exception as e:
            if getattr(writer, "errors", None):  # the failed write itself, naming its file
                raise writer.errors[0] from e
            raise

    job = saver.submit(str(final), write, at_exit=False, hold_every_optimizer=deferred)
    return PendingSave(str(final), group, writer, metadata, job, staging=hidden, forget_plan=forget)


def _plan_and_stage(state_dict, writer, planner, cache: PlanCache | None, group: Group, saver: AsyncSaver,
                    staging: str, busy, deferred_keys: dict) -> tuple:
    """``start``'s collective part: ((plan, metadata, the reused plan's check, hidden directory,
    what drops the plan), staged items, staging error)."""
    final = Path(writer.path)
    with for_group(state_dict, group.pg, cache.layouts if cache is not None else None):
        planning = Planning.begin(state_dict, writer, planner, group, cache)
        hidden, reuse = _prepare(state_dict, writer, group, dict(busy or {}), planning)
        try:
            plan, metadata, check = planning.finish(state_dict, writer, group, reuse)
        except BaseException:
            _abandon(group, writer, hidden, final)
            raise
        forget = functools.partial(cache.forget, planning.key) if check is not None else None
        error, staged = None, None
        try:
            staged = stage(planner, plan, None if staging == "none" else saver.stager, deferred_keys)
        except Exception as e:  # noqa: BLE001 - raised by this rank's write, so by finish() on every rank
            error = e
            saver.stager.abandon()
    return (plan, metadata, check, hidden, forget), staged, error


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
        if pending.forget_plan is not None:  # its check may be what failed: the next save plans again
            pending.forget_plan()
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
