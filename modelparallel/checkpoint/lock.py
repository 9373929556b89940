"""One writer per checkpoint directory."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from .errors import CheckpointError

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
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
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
