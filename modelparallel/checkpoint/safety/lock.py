"""One writer per checkpoint directory, for the whole job.

A job takes the lock of a directory at its first save there and keeps it until it ends
(``job_lock``; the runtime holds it, a new ``smp.init`` releases it): two jobs saving into one
directory would otherwise interleave, and one's retention would delete the other's checkpoints.
The second job's save fails at once, naming the owner.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

from .failure import CheckpointError

LOCK = ".mp-lock"


class DirectoryLocked(CheckpointError):
    """Another live job is saving into the same checkpoint directory."""


class DirectoryLock:
    """The one-writer lock of a checkpoint directory: ``flock`` on ``path/.mp-lock``, which the
    kernel releases when the owner exits or dies (a crashed job leaves no stale lock). The file
    records the owner's host and pid for the error message; it is never deleted (deleting a
    locked file lets a third job lock a new one while the second still holds the old)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd: int | None = None

    def acquire(self) -> "DirectoryLock":
        """Take the lock or raise ``DirectoryLocked`` naming the owner (never waits)."""
        self.path.mkdir(parents=True, exist_ok=True)
        where = self.path / LOCK
        try:  # never through a symlink: that would truncate whatever it points to
            fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{where}: the writer lock is a symlink (to {os.readlink(where)}); "
                                      "refusing to write through it: remove it") from None
            raise type(e)(e.errno, e.strerror, str(where)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # a hard link: truncating it would empty its target
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} hard links"
            raise CheckpointError(f"{where}: the writer lock is {what}; refusing to write through it: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown owner"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirectoryLocked(f"{self.path} is being saved into by another job ({owner}); one "
                                      "writer per checkpoint directory: use another path") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host={socket.gethostname()} pid={os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def held_by(path: str | Path) -> str | None:
    """The owner (``host=... pid=...``) of a live job holding the lock of directory ``path``, or
    None: asked without taking it (a shared lock tried and dropped at once) and without creating,
    truncating or following anything. For a check before a job starts."""
    try:
        fd = os.open(Path(path) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file (nobody saved there yet), or one a save would refuse anyway
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown owner"
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def job_lock(held: dict, path: str | Path) -> DirectoryLock:
    """The job's lock of directory ``path``: taken at its first save there and kept in ``held``
    (the runtime's ``held_locks``) for the rest of the job.

    Raises:
        DirectoryLocked: another live job holds it.
    """
    key = os.path.realpath(path)
    lock = held.get(key)
    if lock is None or lock.fd is None:
        lock = held[key] = DirectoryLock(path).acquire()
    return lock
