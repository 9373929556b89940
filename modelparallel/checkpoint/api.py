"""``smp.save_checkpoint`` and ``smp.resume_from_checkpoint``: SageMaker's checkpoint API.

A resume called before the ``DistributedModel`` / ``DistributedOptimizer`` exist is kept as the
runtime's newest ``resume`` (``Runtime.pending_resume`` while it waits) and applied by their
constructors, as SageMaker defers it: user code can resume first, then build the model as usual.
The resume object also holds what its loads skipped (``last_load_report``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .. import runtime
from .paused_gc import paused_gc
from .background.async_save import AsyncSaver
from .format import export_dtype
from .load import full_load, partial_load
from .load.journal import Policy, check_policy
from .load.parts import LoadReport, USER_CONTENT, read_user_content
from .load.pending import PendingResume
from .safety import commit
from .safety.errors import run_phase, same_on_every_rank
from .safety.files import CheckpointFiles
from .safety.manifest import set_aside_note
from . import single_file
from .save import full, partial as partial_ckpt


@paused_gc()
def save_checkpoint(path: str | Path, tag: str, partial: bool = True, model=None, optimizer=None,
                    user_content: Any = None, translate_if_full: bool = True,
                    num_kept_partial_checkpoints: int | None = None, trust_user_content: bool = False,
                    dtype=None, async_save: bool = False, async_staging: bool = True) -> None:
    """Save a checkpoint (a collective: call it on every rank).

    Args:
        path: the checkpoint directory (created if needed).
        tag: the checkpoint's name, e.g. ``f"step_{step}"``.
        partial: True writes ``path/{tag}_partial/`` (model, optimizer and user content as DCP
            parts, reloadable at any TP/DP layout); False writes ``path/{tag}/``, a Hugging Face
            model directory (a model without an HF key table: its unsharded state dict in
            safetensors), and ``path/user_content_{tag}``; a ``tag`` ending in ``.pt``, ``.pth``
            or ``.bin`` writes SageMaker's single file ``path/{tag}`` instead.
        model, optimizer: default to the last ``DistributedModel`` / ``DistributedOptimizer``
            created (``optimizer`` is not saved by a full checkpoint).
        user_content: returned by ``resume_from_checkpoint``: tensors, numbers, strings, None,
            lists, tuples, dicts (also ``OrderedDict``, ``defaultdict`` of a built-in type),
            sets; anything else raises ``TypeError`` before anything is written.
        translate_if_full: full checkpoints in Hugging Face format (else the distributed format).
        num_kept_partial_checkpoints: keep only this many newest partial checkpoints.
        trust_user_content: store ``user_content`` as a full pickle (any object); loading it
            then needs ``trust_user_content=True`` and runs whatever code the file names.
        dtype: full checkpoints only: export in ``torch.float32`` (a half-precision run's fp32
            master weights), ``torch.float16`` or ``torch.bfloat16``; None: the training dtype.
        async_save: return once the state is captured; a background thread writes, fsyncs and
            commits it (see ``async_save``). Its error is raised on every rank by the next save,
            ``wait_for_checkpoints()`` or ``resume_from_checkpoint``; at exit the library waits
            for it. A full checkpoint gathers the model to rank 0 in the call (a collective),
            then writes in the background.
        async_staging: with ``async_save`` (partial): True (the default) copies the parameters
            and optimizer slots to host memory in the background too, and the optimizer's next
            ``step()`` waits until they are copied; a parameter changed in place another way
            before then fails that save on every rank, naming it. False copies everything in
            the call.

    Raises:
        ValueError: for bad arguments, before anything is written.
        CheckpointError: on every rank if the save failed on any; what was on disk before
            (including ``newest``) is untouched.
    """
    model, optimizer = _defaults(model, optimizer)
    _check_save_args(tag, num_kept_partial_checkpoints, model, partial)
    dtype = export_dtype.check_dtype(dtype)
    if partial and dtype is not None:
        raise ValueError("dtype= applies to full checkpoints (partial=False); a partial checkpoint keeps the "
                         "training dtype and the fp32 master weights")
    if not isinstance(async_staging, bool):
        raise ValueError(f"save_checkpoint: async_staging must be True or False, got {async_staging!r}")
    wait_for_checkpoints()  # at most one save in flight; its error surfaces here
    same_on_every_rank("save_checkpoint", path=path, tag=tag, partial=partial)
    saver = _saver() if async_save else None
    if partial:
        partial_ckpt.save(Path(path), tag, model, optimizer, user_content, num_kept_partial_checkpoints,
                          trust_user_content, saver, async_staging)
    elif single_file.is_file_tag(tag):
        single_file.save(Path(path), tag, model, user_content, translate_if_full, trust_user_content, dtype, saver)
    else:
        full.save(Path(path), tag, model, user_content, translate_if_full, trust_user_content=trust_user_content,
                  dtype=dtype, saver=saver)


def _saver() -> AsyncSaver:
    rt = runtime.current()
    if rt.checkpoint_saver is None:
        rt.checkpoint_saver = AsyncSaver(rt.mesh_cache)
    return rt.checkpoint_saver


def wait_for_checkpoints() -> None:
    """Wait for the asynchronous save in flight (if any) to be committed; raise its error on
    every rank if it failed. Call it on every rank (the error is agreed by all of them)."""
    rt = runtime.current() if runtime.is_initialized() else None
    if rt is not None and rt.checkpoint_saver is not None:
        rt.checkpoint_saver.wait()


def wait_for_staging() -> None:
    """Wait until the asynchronous save in flight has copied the live tensors (what a load into
    the model or optimizer must wait for; not a collective, raises nothing)."""
    rt = runtime.current() if runtime.is_initialized() else None
    if rt is not None and rt.checkpoint_saver is not None:
        rt.checkpoint_saver.wait_staged()


def checkpoint_staging_bytes() -> int:
    """Host memory this rank holds for asynchronous saves (kept and reused between saves)."""
    rt = runtime.current() if runtime.is_initialized() else None
    return rt.checkpoint_saver.stager.nbytes if rt is not None and rt.checkpoint_saver is not None else 0


def _defaults(model, optimizer):
    """SageMaker's defaults: the newest model, and the newest optimizer linked to that model
    if it optimizes that model alone (one spanning several models has no place in one
    model's checkpoint)."""
    rt = runtime.current()
    model = model if model is not None else (rt.models[-1] if rt.models else None)
    if model is not None and hasattr(model, "_mp_partition_now"):  # split a model waiting for its marks
        model._mp_partition_now()
    if optimizer is None and model is not None and model.linked_optimizers:
        newest = model.linked_optimizers[-1]
        optimizer = newest if newest.models == [model] else None
    return model, optimizer


def _check_save_args(tag, keep, model, partial: bool) -> None:
    problems = []
    if not partial and isinstance(tag, str) and (tag.endswith("_partial") or tag.startswith("user_content_")):
        problems.append(f"a full checkpoint's tag may not end in '_partial' or start with 'user_content_' "
                        f"(names of partial checkpoints and user content files); got {tag!r}")
    if model is None:
        problems.append("no model: create a smp.DistributedModel first or pass model=")
    if not isinstance(tag, str) or not tag or "/" in tag or tag.startswith(".") or tag == commit.NEWEST \
            or tag != tag.strip():  # ``newest`` is read stripped: " a" would name "a"'s checkpoint
        problems.append(f"tag must be a non-empty name without '/' or surrounding whitespace, not starting "
                        f"with '.', not '{commit.NEWEST}'; got {tag!r}")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        problems.append(f"num_kept_partial_checkpoints must be an integer >= 1 or None, got {keep!r}")
    if problems:
        raise ValueError("save_checkpoint: " + "; ".join(problems))


@paused_gc()
def resume_from_checkpoint(path: str | Path, tag: str | None = None, partial: bool = True,
                           strict: bool = True, load_optimizer: bool = True,
                           translate_function: Callable | None = None, trust_user_content: bool = False,
                           staging: str | None = None, staging_bucket: int | None = None) -> Any:
    """Load a checkpoint into this job's model and optimizer; returns the saved user content.

    Args:
        path: the directory given to ``save_checkpoint``.
        tag: the checkpoint to load; None loads the one ``path/newest`` names. With
            ``partial=False``, a tag naming a single file (``torch.save`` of a state dict, e.g.
            ``"fullmodel.pt"``) loads that file, read with ``weights_only=True``.
        partial: load a partial checkpoint (model and optimizer, any layout) or a full one
            (model weights only).
        strict: raise listing every missing / unexpected key and shape mismatch; False loads
            what fits and reports the rest (``last_load_report()``).
        load_optimizer: also load the optimizer and loss-scaler state (partial only).
        translate_function: for a full checkpoint, maps the file's keys to the model's
            (default: the architecture's own translation).
        trust_user_content: read user content saved with ``trust_user_content=True`` (full
            pickle: this runs whatever code the file names; only for files you wrote).
        staging: ours, how a failed load is kept from changing anything: "memory" (a staged
            copy of what this rank loads), "journal" (buckets written through an undo journal
            on local disk, put back on failure), "auto" (memory if it fits); None: the config's
            ``checkpoint_staging``.
        staging_bucket: the journal's bucket in bytes; None: ``checkpoint_staging_bucket``.

    If the ``DistributedModel`` (or optimizer) does not exist yet, its load happens when it is
    created. Every part is read into staging (or through the undo journal), each file verified
    against the manifest's checksum as it is read, and checked (keys, shapes, config): a failed
    resume changes nothing and leaves no load pending.

    Raises:
        CheckpointError (on every rank; also a ``FileNotFoundError`` / ``ValueError`` when every
            failing rank raised that type): missing path, unknown tag, ``newest`` naming a
            missing checkpoint; another architecture; strict mismatches (all listed); a missing,
            truncated, corrupted or unlisted file (named); content a checkpoint may not hold.
        JournalError (a CheckpointError): the load failed and the undo journal (named) could not
            put everything back: this rank's model or optimizer is not as it was.
    """
    policy = _policy(staging, staging_bucket)
    wait_for_checkpoints()  # never read what a save in flight is writing
    same_on_every_rank("resume_from_checkpoint", path=path, tag=tag, partial=partial, load_optimizer=load_optimizer)
    rt = runtime.current()
    if rt.resume is not None:  # a new resume replaces one still waiting, even if it fails
        rt.resume.armed = False
        if rt.resume.model_load is not None:  # the model's previous values it kept (memory or journal)
            rt.resume.model_load.release()
            rt.resume.model_load = None
    path = Path(path)
    name = tag if tag is not None or partial else run_phase("resume (locate)", lambda: commit.read_newest(path)
                                                           if path.is_dir() else None)[0]
    if not partial and name is not None and single_file.is_single_file(path, name):
        content, pending = single_file.prepare(path, name, strict, translate_function, trust_user_content, policy)
    else:
        content, pending = _prepare(path, tag, partial, strict, load_optimizer, translate_function,
                                    trust_user_content, policy)
    model, optimizer = _defaults(None, None)
    rt.resume = pending
    if model is not None:
        pending.on_model(model, optimizer if pending.prepare_optimizer is not None else None)
    return content


def _policy(mode: str | None, bucket: int | None) -> Policy:
    """The staging policy: the arguments, else the job's config (checked before any collective)."""
    cfg = runtime.current().config
    mode = cfg.checkpoint_staging if mode is None else mode
    bucket = cfg.checkpoint_staging_bucket if bucket is None else bucket
    problems = check_policy(mode, bucket)
    if problems:
        raise ValueError("resume_from_checkpoint: " + "; ".join(problems))
    return Policy(mode, bucket, runtime.local_size())


def _prepare(path: Path, tag, partial: bool, strict: bool, load_optimizer: bool, translate_function,
             trusted: bool, policy: Policy):
    """Locate the checkpoint, check its structure, read its user content: (content, PendingResume)."""
    directory = Path(locate(path, tag, partial))
    files = CheckpointFiles(directory, run_phase("resume (manifest)", lambda: _manifest(directory, trusted))[0])
    if not partial:
        content = full.resume(path, files, trusted)
        return content, PendingResume(lambda model: _full_model(files, model, strict, translate_function, policy))
    prefixes = (partial_ckpt.MODEL + "/", USER_CONTENT) + ((partial_ckpt.OPTIMIZER + "/",) if load_optimizer else ())
    partial_load.verify(files, prefixes)
    found: dict[str, Any] = {}
    run_phase("resume (user content)",
              lambda: found.update(content=read_user_content(files.read(USER_CONTENT), directory / USER_CONTENT,
                                                             trusted)))
    pending = PendingResume(lambda model: partial_load.prepare_model(files, model, strict, policy))
    if load_optimizer:
        pending.check_optimizer_names = lambda model: partial_load.check_optimizer_names(files, model, strict)
        pending.prepare_optimizer = lambda model, opt: partial_load.prepare_optimizer(files, model, opt, strict,
                                                                                       policy)
    return found["content"], pending


def _full_model(files: CheckpointFiles, model, strict: bool, translate_function, policy: Policy):
    run_phase("full load (architecture)", lambda: partial_ckpt.check_architecture(files.manifest, model))
    return full_load.prepare(files, model, strict, translate_function, policy)


def _manifest(directory: Path, trusted: bool) -> dict:
    manifest = commit.read_manifest(directory)
    if manifest.get("user_content_trusted") and not trusted:
        raise ValueError(f"{directory} was saved with trust_user_content=True: its user content is a full "
                         "pickle, which runs code when read. Resume with trust_user_content=True only if you "
                         "trust whoever wrote it")
    return manifest


def last_load_report() -> dict[str, LoadReport]:
    """Per part ("model", "optimizer"): what the last resume skipped (non-empty only with
    ``strict=False``)."""
    resume = runtime.current().resume if runtime.is_initialized() else None
    return dict(resume.reports) if resume is not None else {}


def locate(path: Path, tag: str | None, partial: bool) -> Path:
    """The checkpoint directory for ``tag`` (or ``newest``), with an error that says what exists."""
    def find():
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint path {path} does not exist")
        name = commit.read_newest(path) if tag is None else (f"{tag}_partial" if partial else tag)
        if name is None:
            raise FileNotFoundError(f"{path} has no '{commit.NEWEST}' file, so tag=None finds nothing; "
                                    f"saved checkpoints: {_saved(path)}")
        commit.safe_name(path, name, f"{path}/{commit.NEWEST} names" if tag is None else "the tag")
        where = f"{path}/{commit.NEWEST} names {name!r}, which" if tag is None else f"checkpoint {name!r}"
        other = f"{tag}_partial" if not partial else tag
        if not (path / name).is_dir() and partial and tag is not None and tag.endswith("_partial") \
                and (path / tag / commit.MANIFEST).is_file():
            raise FileNotFoundError(f"{where} does not exist in {path}; {tag!r} is the directory of the partial "
                                    f"checkpoint tagged {tag[:-len('_partial')]!r}: pass "
                                    f"tag={tag[:-len('_partial')]!r}")
        if not (path / name).is_dir() and tag is not None and (path / other / commit.MANIFEST).is_file():
            raise FileNotFoundError(f"{where} does not exist in {path}, but {other!r} does: it is a "
                                    f"{'partial' if not partial else 'full'} checkpoint, resume it with "
                                    f"partial={not partial}")
        if not (path / name).is_dir():
            raise FileNotFoundError(f"{where} does not exist in {path}; saved checkpoints: {_saved(path)}"
                                    + set_aside_note(path, name))
        kind = commit.read_manifest(path / name).get("format", "")
        if kind.endswith("partial") != partial:
            raise ValueError(f"{where} is a {'partial' if kind.endswith('partial') else 'full'} checkpoint; "
                             f"resume it with partial={not partial}")
        return str(path / name)

    return Path(run_phase("resume (locate)", find)[0])


def _saved(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()
                  if p.is_dir() and not p.name.startswith(commit.HIDDEN) and (p / commit.MANIFEST).is_file())
