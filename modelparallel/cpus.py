"""How many CPU cores this process may run on.

A container's CPU limit or ``taskset`` restricts a process to some of the machine's cores; the
machine's count (``os.cpu_count()``) then overstates them, and ranks given one thread per
counted core oversubscribe the cores they really have. The process's affinity tells, where the
system offers it (Linux); elsewhere the machine's count stands. Imports nothing heavy: the
launcher asks before any rank starts.
"""

from __future__ import annotations

import os


def usable() -> int:
    """The cores this process may run on (at least one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this system
        return os.cpu_count() or 1
