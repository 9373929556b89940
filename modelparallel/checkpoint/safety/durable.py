"""Durable writes: fsync of files and directories, a file replaced atomically, and the hidden
names every temporary of ours carries.

Kept apart from ``commit`` because these are the primitives every step of a commit (and the
CLI's conversions) is built from, with no knowledge of checkpoints, manifests or retention.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

HIDDEN = ".mp-"


def named(error: OSError, path) -> OSError:
    """``error`` naming ``path`` (an error from a file object names no file)."""
    if not isinstance(error, OSError) or error.filename or error.errno is None:
        return error
    return type(error)(error.errno, error.strerror or str(error), str(path))


def new_nonce() -> str:
    return uuid.uuid4().hex[:12]


def hidden_name(kind: str, nonce: str, name: str) -> str:
    """``.mp-{kind}-{nonce}-{name}``: every temporary of ours starts with ``.mp-``."""
    return f"{HIDDEN}{kind}-{nonce}-{name}"


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's fsync persists the names in it); an error
    names ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise named(e, path) from None


def fsync_tree(root: str | Path) -> None:
    """fsync every directory under ``root`` (files are fsynced by whoever wrote them)."""
    for dirpath, _, _ in os.walk(root):
        fsync_path(dirpath)


def write_file_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one; a
    failed write removes its temporary file and raises naming ``path``."""
    path = Path(path)
    tmp = path.parent / hidden_name("tmp", new_nonce(), path.name)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise named(e, path) from None
    fsync_path(path.parent)

