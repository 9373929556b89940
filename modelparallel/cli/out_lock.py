"""One job per ``--out``: the launcher of ``modelparallel train`` holds a lock on its output
directory while its ranks run, and a second launcher given the same ``--out`` refuses before launch.

A run writes ``metrics.json``, ``loss.png`` and ``failure.log`` into ``--out``, whatever it read
there: two jobs with one ``--out`` overwrite each other's. The checkpoints' writer lock
(``checkpoint.safety.lock``) guards only jobs that save, and only from their first save on: a
reader-only ``--resume`` (no ``--save-every``) of a directory another job is training into, or a
job that has not saved yet, went unnoticed, and the last to end replaced the other's metrics.

The lock is ``flock`` on ``OUT/.mp-out-lock``, which the kernel releases when the launcher exits
or dies (no stale lock after a SIGKILL); the file records the owner's host and pid for the
message, and is never deleted (a deleted locked file would let a third job lock a new one). The
same form as the checkpoints' lock, written here because the launcher imports no torch, and the
checkpoint package does on import.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

LOCK = ".mp-out-lock"
CHECKPOINT_LOCK = ".mp-lock"
"""``checkpoint.safety.lock.LOCK``, the checkpoints' writer lock, named here so that the launcher
asks it without importing the checkpoint package (torch); a test holds the two equal."""
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _open(out: Path, flags: int, name: str = LOCK) -> int | None:
    """A descriptor of the lock file (never through a link), or None when there is none or it is
    not a regular file of one link (not ours: never written through)."""
    try:
        fd = os.open(Path(out) / name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # truncating a hard link would empty its target
        os.close(fd)
        return None
    return fd


def _owner(fd: int) -> str:
    return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown owner"


def holder(out: Path, name: str = LOCK) -> str | None:
    """The owner (``host=... pid=...``) of the live launcher writing into ``out`` (with ``name``
    ``CHECKPOINT_LOCK``: of the live job saving checkpoints into ``out``), or None: asked with a
    shared lock tried and dropped at once, creating nothing. For the check before launch."""
    fd = _open(out, os.O_RDONLY, name)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return _owner(fd) if e.errno in _BUSY else None
    finally:
        os.close(fd)
    return None


def take(out: Path) -> tuple[int | None, str | None]:
    """(descriptor holding the lock of ``out`` until it is closed or this process ends, None) or
    (None, the owner) when another live launcher holds it. A lock file that is no regular file
    of one link (a symlink, a hard link, a directory) is left alone and the run goes unguarded:
    (None, None)."""
    fd = _open(out, os.O_RDWR | os.O_CREAT)
    if fd is None:
        return None, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        owner = _owner(fd) if e.errno in _BUSY else None
        os.close(fd)
        return None, owner
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host={socket.gethostname()} pid={os.getpid()}\n".encode(), 0)
    return fd, None
