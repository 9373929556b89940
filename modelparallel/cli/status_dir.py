"""The launcher's status directory under the temporary directory, and the sweep of those whose
launcher died without removing its own.

A launcher removes its status directory when its run ends, but a launcher killed by SIGKILL (or
the out-of-memory killer) runs no cleanup, and each such death would leave one directory in /tmp
for good. So the directory's name carries its launcher's pid and that process's start time, and
every launcher first removes the directories whose launcher is no longer running: a pid alone
could since have been reused by another process, a (pid, start time) pair is not reused. Only
this user's directories of that form, not links, are ever touched.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "modelparallel-"
_NAME = re.compile(r"^modelparallel-[a-z]+-(\d+)-(\d+)-")


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux /proc), None if it is
    not running (or /proc is unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] == b"Z" else int(fields[19])  # a zombie has ended
    except (OSError, IndexError, ValueError):
        return None


def _launcher_alive(pid: int, start: int) -> bool:
    if not os.path.isdir("/proc/self"):  # no /proc: never sweep what cannot be checked
        return True
    return process_start(pid) == start


def sweep(parent: Path | None = None) -> list[Path]:
    """Remove this user's status directories in ``parent`` (default: the temporary directory)
    whose launcher is gone; returns those removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = _NAME.match(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _launcher_alive(int(m[1]), int(m[2])):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def create(kind: str) -> Path:
    """A new status directory for a launcher of ``kind`` (``train``, ``run``), after sweeping the
    leftovers of dead launchers."""
    sweep()
    start = process_start(os.getpid())
    owner = f"{os.getpid()}-{start}-" if start is not None else ""  # unknown: a name no sweep matches
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-{owner}"))
