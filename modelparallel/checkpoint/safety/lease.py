"""A read lease on an open checkpoint file: another process's write waits until the load is done.

A memory-mapped file that another process truncates while it is read ends the reader with
SIGBUS: no exception, no message, every rank reading it gone at once. A ``torch.save`` over the
same path does exactly that (it opens with truncation), as do a copy into it and ``truncate``.
A write that does not truncate is worse: the load maps bytes other than those it checked.

Linux's read lease (``F_SETLEASE``) covers both: while it is held, any other open of the file for
writing, and any truncation, waits until the holder lets go (at most the kernel's
``/proc/sys/fs/lease-break-time`` seconds, 45 by default: a load longer than that loses the
protection), and it cannot be taken while the file is open for writing anywhere. Leases need
the file's owner (or ``CAP_LEASE``) and a local file system; where none can be taken the load
maps the file unprotected, as it did before.

The kernel announces a break with a signal: ``SIGURG`` (ignored unless a program handles it)
instead of the default ``SIGIO``, whose default action ends the process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import signal
import sys
from collections.abc import Iterator

F_SETLEASE, F_SETSIG = 1024, 10
"""Linux's ``fcntl`` commands (``F_LINUX_SPECIFIC_BASE`` + 0, and ``F_SETSIG``)."""

HELD, BUSY, NONE = "held", "busy", "none"


@contextlib.contextmanager
def read_lease(fd: int) -> Iterator[str]:
    """Hold a read lease on ``fd`` (opened read-only) for the block, released at its end.

    Yields ``HELD``; ``BUSY`` when the file is open for writing somewhere right now (nothing it
    holds may be mapped: the caller reads it through the descriptor instead); ``NONE`` where
    this platform, file system or owner allows no lease.
    """
    if sys.platform != "linux":
        yield NONE
        return
    try:
        fcntl.fcntl(fd, F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
    except OSError as e:
        yield BUSY if e.errno in (errno.EAGAIN, errno.EBUSY) else NONE
        return
    try:
        yield HELD
    finally:
        with contextlib.suppress(OSError):  # closing the descriptor releases it too
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
