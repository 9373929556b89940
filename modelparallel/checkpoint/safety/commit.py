"""Crash-safe files and directories: staging, fsync, checksums, atomic commit, ``newest``, retention.

The rules, each against a failure that half-written checkpoints are known to cause:

* A checkpoint is written into a hidden staging directory (``.mp-staging-...``) and becomes
  visible only through one atomic ``rename`` after every file and ``manifest.json`` (sizes and
  CRC32 of every file) is written and fsynced. A visible checkpoint directory is complete by
  construction; a crash leaves only hidden leftovers, which the next save removes.
* ``path/newest`` is written last, through a temporary file, fsync and rename: it never names a
  checkpoint that is not complete, and a crash leaves the previous one in place.
* Replacing a checkpoint of the same tag swaps the two directories atomically
  (``renameat2(RENAME_EXCHANGE)`` on Linux), so the old one stays whole until the new one is in.
* Deleting (retention, replaced checkpoints) first renames into ``.mp-trash-...``, so a crash
  mid-delete never leaves a half-deleted directory under a checkpoint's name.
* One writer per directory: a save holds ``DirectoryLock`` (``.mp-lock``) from before it cleans
  leftovers until after it commits, so a second job saving into the same directory fails at
  once naming the owner, instead of deleting the first job's staging directory.
* A manifest is checked on read (``read_manifest``): fields and types, and every path in it
  relative and inside the checkpoint; a bad one is a ``ManifestError`` naming the file.

Everything here is local file work; the caller decides which rank does what. The primitives it
is built from live in ``durable`` (fsync, atomic file writes, hidden names) and ``checksums``
(size and CRC32 of files); they are re-exported here, where callers have always found them.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from .checksums import (  # noqa: F401 - part of this module's API
    crc32, data_files, file_checksum, share, synced_checksum, verify_file)
from .durable import (  # noqa: F401 - part of this module's API
    HIDDEN, fsync_path, fsync_tree, hidden_name, named, new_nonce, write_file_atomic)
from .failure import CheckpointError
from .files import read_small
from .lock import LOCK, DirectoryLock, DirectoryLocked  # noqa: F401 - part of this module's API
from .manifest import (  # noqa: F401 - part of this module's API
    MANIFEST, TRASH, ManifestError, check_committed, manifest_problems, read_manifest, restore_swapped_out, safe_name,
    unlisted_files)

logger = logging.getLogger("modelparallel")
NEWEST = "newest"


def write_manifest(directory: str | Path, manifest: dict) -> None:
    write_file_atomic(Path(directory) / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the system cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def commit_dir(staging: str | Path, final: str | Path) -> None:
    """Make the complete ``staging`` directory visible as ``final`` in one atomic step.

    An existing ``final`` (same tag saved again) is swapped out whole and then deleted; where
    an atomic swap is unavailable it is first moved aside, leaving a short window without it
    (a crash there leaves it whole as ``.mp-trash-...``, which ``restore_swapped_out`` puts back).
    """
    staging, final = Path(staging), Path(final)
    fsync_tree(staging)
    if final.exists():
        if not _exchange(staging, final):
            aside = final.parent / hidden_name("trash", new_nonce(), final.name)
            os.rename(final, aside)
            try:
                os.rename(staging, final)
            except BaseException:
                os.rename(aside, final)  # the old checkpoint back under its name
                raise
            staging = aside
        fsync_path(final.parent)
        remove_dir(staging)
    else:
        os.rename(staging, final)
    fsync_path(final.parent)


def remove_dir(directory: str | Path) -> None:
    """Delete a directory tree: renamed into hidden trash first, so it disappears atomically."""
    directory = Path(directory)
    trash = directory
    if not directory.name.startswith(HIDDEN):
        trash = directory.parent / hidden_name("trash", new_nonce(), directory.name)
        os.rename(directory, trash)
        fsync_path(directory.parent)
    shutil.rmtree(trash)


_OURS = re.compile(r"^\.mp-(staging|tmp|trash)-[0-9a-f]{12}-[^/]+$")
"""The names of the temporaries this module makes (``hidden_name``); nothing else is removed."""


def clean_leftovers(path: str | Path) -> list[str]:
    """Remove what interrupted saves left in ``path``: entries named as this module names its
    temporaries (a user's other ``.mp-*`` entries stay). Call it only while holding
    ``DirectoryLock``: then no other live job has anything in ``path``."""
    removed = []
    for entry in sorted(Path(path).iterdir()):
        trash = TRASH.match(entry.name)
        if trash and restore_swapped_out(path, trash.group(1)):
            continue
        if _OURS.match(entry.name):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry.name)
    return removed


def check_replaceable(path: str | Path, name: str, single_file: bool = False) -> None:
    """A save of checkpoint ``name`` may replace ``path/name`` only if it is a checkpoint this
    library wrote (a real directory with a readable manifest; with ``single_file``, a regular
    file), never a symlink or anything else.

    Raises:
        ValueError: naming the entry, before anything is written.
    """
    entry = Path(path) / name
    if entry.is_symlink():
        raise ValueError(f"{entry}: {name!r} is a symlink (to {os.readlink(entry)}); a save never replaces a "
                         "link or writes through it: remove it or choose another tag")
    if single_file:
        if entry.exists() and not entry.is_file():
            raise ValueError(f"{entry} exists and is not a file; a single-file checkpoint never replaces it")
        return
    if entry.exists():
        try:
            read_manifest(entry)
        except (OSError, ValueError) as e:
            raise ValueError(f"{entry} exists and is not a checkpoint this library wrote ({e}); a save never "
                             "replaces it: remove it or choose another tag") from None


def new_staging(path: str | Path, name: str) -> Path:
    """A fresh hidden staging directory for checkpoint ``name`` in ``path`` (created if needed),
    after removing what interrupted saves left there."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    clean_leftovers(path)
    staging = path / hidden_name("staging", new_nonce(), name)
    staging.mkdir()
    return staging


def write_newest(path: str | Path, name: str) -> None:
    """Point ``path/newest`` at checkpoint directory ``name`` (written last, atomically)."""
    write_file_atomic(Path(path) / NEWEST, (name + "\n").encode())


NEWEST_LIMIT = 4096
"""Most bytes a ``newest`` pointer may have (a directory name and a newline): a forged large
file is refused, not read into memory on every rank."""


def read_newest(path: str | Path) -> str | None:
    """The checkpoint directory name in ``path/newest``, or None if there is no such file. Read
    once from its descriptor (``read_small``: no symlink, a regular file, at most
    ``NEWEST_LIMIT`` bytes).

    Raises:
        ValueError: too large or not text, naming the file.
        UnsafeCheckpointError: a symlink, FIFO or hard link, naming the file.
    """
    f = Path(path) / NEWEST
    try:
        data = read_small(f, NEWEST_LIMIT)
    except FileNotFoundError:
        return None
    try:
        return data.decode().strip() or None
    except UnicodeDecodeError:
        raise ValueError(f"{f}: not a checkpoint name (not UTF-8 text)") from None


def saved_at(path: str | Path) -> int:
    """The time a new checkpoint's manifest records (``saved_at_ns``): now, or just after the
    checkpoint ``newest`` names when the clock reads earlier (stepped back since that save), so
    that the order retention and ``--resume`` read from the manifests is the order of the saves."""
    now = time.time_ns()
    try:
        name = read_newest(path)
        last = int(read_manifest(Path(path) / name)["saved_at_ns"]) if name else None
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):  # no readable newest: the clock alone
        return now
    return now if last is None or now > last else last + 1


def saved_checkpoints(path: str | Path, suffix: str = "_partial") -> list[tuple[int, str]]:
    """(saved_at_ns, directory name) of every complete checkpoint ending in ``suffix``, oldest
    first. Complete means a real directory (not a symlink) holding a readable manifest of this
    library; anything else is never counted, never deleted. Ordered by the manifest's time, not
    by directory mtimes: those are reset by a copy or a restore from object storage (SageMaker's
    checkpoint sync), the manifest travels with the files; whoever could forge it could as well
    delete the directories."""
    found = []
    for entry in Path(path).iterdir():
        if entry.is_dir() and not entry.is_symlink() and not entry.name.startswith(HIDDEN) \
                and entry.name.endswith(suffix):
            try:
                found.append((int(read_manifest(entry)["saved_at_ns"]), entry.name))
            except (OSError, ValueError, KeyError, TypeError, CheckpointError):
                continue
    return sorted(found)


def retain(path: str | Path, keep: int, protect: str) -> list[str]:
    """``apply_retention`` after a committed save: a checkpoint that cannot be deleted is
    logged, not raised (the save itself succeeded; the next save tries again)."""
    try:
        return apply_retention(path, keep, protect)
    except (OSError, CheckpointError, ValueError) as e:
        logger.warning("checkpoint retention in %s failed (the save itself succeeded): %s", path, e)
        return []


def apply_retention(path: str | Path, keep: int, protect: str | None) -> list[str]:
    """Delete all but the ``keep`` newest complete partial checkpoints; never ``protect`` (the
    one ``newest`` names). Returns the deleted directory names."""
    names = [name for _, name in saved_checkpoints(path)]
    doomed = [n for n in names[:max(len(names) - keep, 0)] if n != protect]
    for name in doomed:
        remove_dir(Path(path) / name)
    return doomed
