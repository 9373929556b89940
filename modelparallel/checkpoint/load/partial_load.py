"""Loading a partial checkpoint, all or nothing: checked, read into staging, then applied.

The steps, each a phase every rank agrees on (``errors.run_phase``), so a failure anywhere
raises everywhere before anything live changes:

1. ``verify``: every listed file of the parts to load is a regular file inside the checkpoint at
   its recorded size, and the directory holds nothing the manifest does not list (rank 0);
2. ``prepare_model``: architecture, structural config, keys and shapes against the model part's
   metadata; then the model part read into staging tensors, every file verified as it is read;
3. ``prepare_optimizer``: targets built from the optimizer part's metadata, read (verified),
   then checked: the optimizer's class, its parameter groups, keys, shapes, the loss scaler.

Only then does the caller apply them (``staging.ModelLoad.apply``, ``OptimizerLoad.apply``):
local copies and pointer swaps that cannot fail half-way for I/O reasons.

In journal mode (``journal.Policy``: the staged copy would not fit) steps 2 and 3 read through
buckets into the live tensors (the optimizer's own slots and masters), their old values in an
undo journal; a failure in any later phase on any rank puts them back before it is raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from ...pipeline.split import elsewhere
from ..format import model_config
from ..safety import commit
from ..safety.errors import run_phase, single_error
from ..safety.files import CheckpointFiles, fstat, open_inside
from ..save.partial import MODEL, OPTIMIZER, check_architecture
from . import model_masters, optim_part, parts, staging
from .journal import BucketPlanner, Cost, Journal, Policy
from .parts import LoadReport


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _stat_problem(files: CheckpointFiles, rel: str) -> str | None:
    """None if ``rel`` opens as a regular file inside at its recorded size, else a message."""
    import os

    try:
        fd = open_inside(*files.inside(rel))
    except FileNotFoundError:
        return f"{files.directory / rel}: missing (listed in the manifest)"
    except (OSError, ValueError) as e:
        return str(e)
    try:
        size = fstat(fd, files.directory / rel).st_size
    except OSError as e:
        return str(e)
    finally:
        os.close(fd)
    want = files.manifest["files"][rel]["size"]
    return None if size == want else \
        f"{files.directory / rel}: size {size} bytes, manifest says {want} (truncated or overwritten)"


def verify(files: CheckpointFiles, prefixes: tuple[str, ...]) -> None:
    """Check the structure of the parts in ``prefixes`` (shared among ranks): raise on every rank,
    naming every bad file. Checksums are checked by the reads themselves."""
    rank, world = _rank_world()
    sizes = {f: e["size"] for f, e in files.manifest["files"].items() if f.startswith(prefixes)}
    mine = commit.share(sizes, rank, world)
    problems = run_phase("load (verify)", lambda: [msg for f in mine if (msg := _stat_problem(files, f))]
                         + (commit.unlisted_files(files.directory, files.manifest) if rank == 0 else []))
    single_error("load (verify): files do not match the manifest", [m for p in problems for m in p])


def _strict(part: str, report: LoadReport, strict: bool, extra: list[str] = ()) -> None:
    problems = (report.problems(part) if strict else []) + list(extra)
    if problems:
        raise ValueError("checkpoint does not fit (strict=True):\n  - " + "\n  - ".join(problems))


def prepare_model(files: CheckpointFiles, model, strict: bool, policy: Policy | None = None) -> staging.ModelLoad:
    """Check the model part against ``model`` and read it into staging, or through an undo
    journal where ``policy`` says so (collectives; a failure leaves the model as it was)."""
    run_phase("load (model: architecture)", lambda: check_architecture(files.manifest, model))
    state = parts.model_state(model.module)

    def check():
        report = parts.compare(state, files, MODEL, elsewhere(model.module))
        config = model_config.differences(files.manifest.get("config"), getattr(model.module, "config", None))
        report = LoadReport(report.missing_keys, report.unexpected_keys, report.mismatched_shapes + config)
        _strict(MODEL, report, strict)
        return report

    report = run_phase("load (model: keys)", check)[_rank_world()[0]]
    load = staging.agreed("load (model: targets)",
                          lambda: staging.begin(report, state, parts.loadable(state, report), policy))
    planner = BucketPlanner(load.journal, set(load.keys)) if load.journal is not None else None
    load.run("load (model: read)", lambda: parts.read_part(load.targets(), files, MODEL, set(load.keys), planner))
    return load


def check_optimizer_names(files: CheckpointFiles, model, strict: bool) -> None:
    """Before any weight is loaded, with no optimizer yet: the optimizer part names this model's
    parameters at their shapes. (A checkpoint without an optimizer part is refused when an
    optimizer is created: a job may never create one.)"""
    def check():
        if OPTIMIZER not in files.manifest["parts"] or not strict:
            return
        problems = optim_part.check_names_against_model(model.module, files.metadata(OPTIMIZER))
        _strict(OPTIMIZER, LoadReport([], []), False, problems)

    run_phase("load (optimizer: names)", check)


@dataclass
class OptimizerLoad:
    """An optimizer part read and checked; ``apply`` replaces the optimizer's state with it. In
    journal mode the live slots already hold the loaded values and ``journal`` their old ones
    until ``apply`` succeeded (``discard`` puts them back)."""

    report: LoadReport
    change: Callable[[], None]
    journal: Journal | None = None
    cost: Cost | None = None

    def apply(self) -> None:
        try:
            self.change()
        except BaseException as e:
            self.discard(e)
            raise
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    def discard(self, error: BaseException) -> None:
        """Put back the live slots a journal-mode read overwrote (nothing to do otherwise)."""
        if self.journal is not None:
            journal, self.journal = self.journal, None
            journal.abort(error)


def _class_problem(files: CheckpointFiles, optimizer) -> str | None:
    saved, mine = files.manifest.get("optimizer_class"), type(optimizer.optimizer).__name__
    if saved and saved != mine:
        return f"optimizer: the checkpoint holds {saved} state, this optimizer is {mine}"
    return None


def prepare_optimizer(files: CheckpointFiles, model, optimizer, strict: bool,
                      policy: Policy | None = None) -> OptimizerLoad:
    """Plan, read (verified) and check the optimizer part (collectives); nothing live changes
    (in journal mode, ``policy``: the live slots are overwritten and put back on failure)."""
    def present():
        if OPTIMIZER not in files.manifest["parts"]:
            raise ValueError(f"{files.directory} holds no optimizer state (saved without an optimizer); "
                             "resume with load_optimizer=False")
        if strict and (problem := _class_problem(files, optimizer)):
            raise ValueError(f"checkpoint does not fit (strict=True):\n  - {problem}")

    run_phase("load (optimizer: present)", present)
    found: dict[str, Any] = {}  # tensors stay local: a phase's result is sent to every rank
    reuse = policy is not None and _class_problem(files, optimizer) is None
    def plan():
        metadata = files.metadata(OPTIMIZER)
        try:
            found["plan"] = optim_part.plan_load(model.module, optimizer, metadata, reuse)
        except ValueError as e:  # a saved entry that cannot be loaded: name the file that holds it
            raise ValueError(f"{files.directory / OPTIMIZER / '.metadata'}: {e}") from None
        found["protect"] = _protect(found["plan"], policy)
        in_model = found["protect"][0] is None and MODEL in files.manifest["parts"]
        found["masters"] = model_masters.plan(model.module, optimizer, found["plan"].nested,
                                              files.metadata(MODEL)) if in_model else {}
        return in_model, bool(found["masters"])

    wants = run_phase("load (optimizer: plan)", plan)
    # masters from the model part only if no rank journals (a rank recreating them would leave
    # replicated masters unequal); a collective read, so every rank takes part
    from_model = all(w[0] for w in wants) and any(w[1] for w in wants)
    masters = found["masters"] if from_model else {}
    planned = found["plan"]
    journal, cost = found["protect"]
    keys = set(parts.flatten(planned.nested))
    planner = BucketPlanner(journal, set(planned.reused)) if journal is not None else None
    other_class = _class_problem(files, optimizer)

    def read():
        parts.read_part(planned.nested, files, OPTIMIZER, keys, planner)
        if from_model:
            targets = {key: target for key, (_, target) in masters.items()}
            parts.read_part(targets, files, MODEL, set(targets))
            model_masters.merge(planned.nested, masters)
        if journal is not None:
            journal.flush()

    def check():
        report = planned.report()
        if other_class:  # strict=False: the whole part is skipped, and said so
            return LoadReport(report.missing_keys, report.unexpected_keys, [other_class])
        _strict(OPTIMIZER, report, strict)
        optim_part.check_scaler(optimizer, planned.nested)
        return report

    try:
        run_phase("load (optimizer: read)", read)
        report = run_phase("load (optimizer: keys)", check)[_rank_world()[0]]
    except BaseException as e:
        if journal is not None:
            journal.abort(e)
        raise
    if journal is not None:
        cost = Cost.of(journal)
    change = (lambda: None) if other_class else \
        (lambda: optim_part.apply_optimizer_state(model.module, optimizer, planned.nested))
    return OptimizerLoad(report, change, journal, cost)


def _protect(planned: optim_part.Planned, policy: Policy | None) -> tuple[Journal | None, Cost | None]:
    """Journal mode if ``policy`` says the second copy of the live slots (and masters) would not
    fit; else each live tensor planned as a target gets a fresh one (staging in memory)."""
    live = {key: holder[slot] for key, (holder, slot) in planned.reused.items()}
    need = staging.nbytes(live)
    if policy is not None and policy.use_journal(need):
        return Journal(policy.bucket), None
    for key, (holder, slot) in planned.reused.items():
        holder[slot] = staging.like(live[key])
    planned.reused = {}
    return None, Cost("memory", need)
