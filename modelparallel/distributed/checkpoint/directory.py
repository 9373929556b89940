"""The directory of a v2 checkpoint: written hidden, committed whole, opened only as committed.

A save writes into a hidden staging directory next to ``checkpoint_id``
(``.mp-staging-{nonce}-{name}``), every file fsynced and checksummed; the coordinator then
writes ``checkpoint_manifest.json`` (size and CRC32 of every file) and renames the staging
directory into place in one atomic step (the checkpoint package's ``commit.commit_dir``: an
existing checkpoint is swapped out whole). Until then the previous checkpoint under that name is
untouched and loads; a save that never finishes leaves only a hidden directory.

The committed directory is what ``torch.distributed.checkpoint.save`` writes (``.metadata`` and
``__{rank}_{n}.distcp``) plus the manifest and, for local state dicts, their layout record:
plain DCP tools read it as any DCP checkpoint. A load opens it through
``files.CheckpointFiles``: only the files the manifest lists, each a regular file inside,
verified as it is read. A directory plain DCP wrote (no manifest) loads the same way with sizes
taken from the directory and no checksums to compare, unless its ``.metadata`` says this library
saved it (``SAVED_BY``, which plain DCP ignores): then the manifest was lost or removed, and the
load is refused rather than silently done without checksums.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from pathlib import Path

import torch

from torch.distributed.checkpoint import FileSystemWriter, StorageWriter

from ...checkpoint.safety import commit
from ...checkpoint.safety.files import CheckpointFiles, CorruptFileError
from ...checkpoint.safety.manifest import MANIFEST, read_manifest, set_aside_note
from ...checkpoint.save.writer import CheckpointWriter

FORMAT = "modelparallel-dcp"
_CHECKPOINT_FILE = re.compile(r"^(\.metadata(\.tmp)?|__\d+\.metadata|__\d+_\d+\.distcp|"
                              + re.escape(MANIFEST) + r"|\.sm_local_layout\.json)$")
"""The names a DCP checkpoint directory holds (a save may replace a directory of only these)."""
SAVED_BY = "modelparallel.manifest"
"""Key of ``Metadata.planner_data`` (DCP's flattening record, read by key, so an extra key is
ignored) that marks a checkpoint this library saved: it has a manifest."""


def check_replaceable(final: Path) -> None:
    """A save may replace ``final`` only if it is absent, empty or a checkpoint directory.

    Raises:
        ValueError: naming ``final`` and what in it is not part of a checkpoint.
    """
    if final.is_symlink():
        raise ValueError(f"{final} is a symlink (to {os.readlink(final)}); a save never replaces a link or writes "
                         "through it: give the directory itself")
    if not final.exists():
        return
    if not final.is_dir():
        raise ValueError(f"{final} exists and is not a directory; a checkpoint save never replaces it")
    with os.scandir(final) as entries:
        others = sorted(e.name for e in entries if not (e.is_file(follow_symlinks=False)
                                                        and _CHECKPOINT_FILE.match(e.name)))
    if others:
        raise ValueError(f"{final} holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}, which "
                         "is not part of a checkpoint; a save replaces the whole directory, so it never replaces "
                         "this one: move those away or choose another checkpoint_id")


def check_not_pending(final: Path, busy: dict) -> None:
    """Refuse a save of ``final`` while another queue has one pending (``busy``: path -> whether
    in the saving queue): its staging directory would be taken for a leftover, and the older
    save would commit over this one.

    Raises:
        ValueError: naming ``final``.
    """
    if busy.get(str(final)) is False:
        raise ValueError(f"{final}: an asynchronous save of it is still pending in another queue (not finalized); "
                         "finalize it first (maybe_finalize_async_calls(blocking=True)) or save to another "
                         "checkpoint_id")


def remove_leftovers(final: Path) -> list[str]:
    """Remove the hidden directories that interrupted saves of ``final`` left beside it (named
    as ``new_staging`` and ``commit.remove_dir`` name them; nothing else). Only while no other
    save of ``final`` is in flight."""
    ours = re.compile(r"^\.mp-(staging|trash)-[0-9a-f]{12}-" + re.escape(final.name) + "$")
    if not final.parent.is_dir():
        return []
    commit.restore_swapped_out(final.parent, final.name)
    with os.scandir(final.parent) as entries:
        doomed = sorted(e.name for e in entries if ours.match(e.name) and e.is_dir(follow_symlinks=False))
    for name in doomed:
        shutil.rmtree(final.parent / name)
    return doomed


def staging_path(final: Path, nonce: int) -> Path:
    """The hidden directory next to ``final`` a save with ``nonce`` (48 bits) writes into."""
    return final.parent / commit.hidden_name("staging", f"{nonce:012x}", final.name)


def new_staging(final: Path) -> int:
    """Make a fresh hidden directory next to ``final`` (its parent created if needed); its nonce
    (``staging_path`` names it: a number, so that the ranks learn it by an all-reduce)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    nonce = int(commit.new_nonce(), 16)
    staging_path(final, nonce).mkdir()
    return nonce


def fsynced_sums(staging: Path, names, known: dict[str, dict]) -> dict[str, dict]:
    """Size and CRC32 of the files ``names`` in ``staging``, each fsynced; ``known`` (by name):
    sums computed while writing, so those files are not read again."""
    return {name: commit.synced_checksum(staging / name, known.get(name)) for name in sorted(set(names))}


def commit_checkpoint(staging: Path, final: Path, sums: dict[str, dict]) -> None:
    """The coordinator's commit: every file of ``staging`` checksummed (those in ``sums``
    already were, by the ranks that wrote them), the manifest written, the directory renamed
    into place as ``final``, and the result checked against the manifest.

    Raises:
        OSError: naming the file or directory at fault; ``final`` is then as it was.
    """
    files = dict(sums)
    rest = [name for name in commit.data_files(staging) if name not in files]
    files.update(fsynced_sums(staging, rest, {}))
    manifest = {"format": FORMAT, "version": 1, "files": files, "saved_at_ns": time.time_ns(),
                "torch_version": torch.__version__}
    commit.write_manifest(staging, manifest)
    commit.commit_dir(staging, final)
    commit.check_committed(final, manifest)


def marked(metadata):
    """``metadata`` marked as saved here (``SAVED_BY``); unchanged when its ``planner_data`` is
    not DCP's dict (a custom planner's)."""
    if not isinstance(metadata.planner_data, dict):
        return metadata
    return dataclasses.replace(metadata, planner_data={**metadata.planner_data, SAVED_BY: MANIFEST})


def check_manifest_kept(files: CheckpointFiles) -> None:
    """Refuse a checkpoint without a manifest whose ``.metadata`` says this library saved it.

    Raises:
        CorruptFileError: naming the missing manifest.
    """
    data = files.metadata("").planner_data
    if files.manifest["format"] != FORMAT and isinstance(data, dict) and SAVED_BY in data:
        raise CorruptFileError(f"{files.directory / MANIFEST}: missing, but this checkpoint was saved by modelparallel, "
                               "which always writes it: without it no file's checksum can be verified (a damaged or "
                               "altered file would load). Restore the whole directory, or load it unverified with "
                               "torch.distributed.checkpoint.load")


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def checkpoint_files(path: Path) -> CheckpointFiles:
    """The files a load of ``path`` may open: the manifest's, or (a directory plain DCP wrote)
    the regular files in it, with their sizes and no checksums.

    Raises:
        FileNotFoundError: no checkpoint there, naming ``path``.
        ManifestError: a manifest that is malformed or of another kind of checkpoint.
    """
    if os.path.lexists(path / MANIFEST):
        manifest = read_manifest(path)
        if manifest["format"] != FORMAT:
            raise ValueError(f"{path} is a {manifest['format']} checkpoint (smp.save_checkpoint's): load it with "
                             "smp.resume_from_checkpoint")
        return CheckpointFiles(path, manifest)
    try:
        with os.scandir(path) as entries:
            files = {e.name: {"size": e.stat(follow_symlinks=False).st_size, "crc32": None}
                     for e in entries if e.is_file(follow_symlinks=False)}
    except OSError as e:
        note = set_aside_note(path.parent, path.name) if isinstance(e, FileNotFoundError) else ""
        raise type(e)(e.errno, f"{e.strerror}{note}" if note else e.strerror, str(path)) from None
    if ".metadata" not in files:
        raise FileNotFoundError(f"{path} is not a complete checkpoint: no .metadata (nor {MANIFEST})")
    return CheckpointFiles(path, {"format": "dcp", "files": files})


def writer_for(checkpoint_id, storage_writer: StorageWriter | None) -> StorageWriter:
    """The storage writer a call names: the one given, else a ``FileSystemWriter`` at
    ``checkpoint_id`` (a local or shared file system path)."""
    if storage_writer is not None:
        if not isinstance(storage_writer, FileSystemWriter):
            raise NotImplementedError(f"storage_writer={type(storage_writer).__name__}: only file system writers "
                                      "(FileSystemWriter, DistributedFileSystemWriter) are supported: a save is "
                                      "committed by renaming a directory")
        if checkpoint_id is not None:
            storage_writer.reset(checkpoint_id)
        return storage_writer
    if checkpoint_id is None:
        raise ValueError("a checkpoint save needs checkpoint_id (a directory) or storage_writer")
    path = os.fspath(checkpoint_id)
    if "://" in path:
        raise NotImplementedError(f"checkpoint_id={path!r}: only file system paths are supported here "
                                  "(S3 checkpoints are not built; mount the bucket or copy after saving)")
    return CheckpointWriter(path)
