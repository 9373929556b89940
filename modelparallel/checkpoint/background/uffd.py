"""The kernel interface of write tracking (``pages``): userfaultfd in asynchronous write-protect
mode, ``PAGEMAP_SCAN`` on ``/proc/self/pagemap``, and which mappings ``/proc/self/maps`` lists as
private anonymous memory. Linux's request numbers and flags, called through ctypes (no compiled
extension); every failure is an ``OSError`` the caller turns into reading the tensors instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re

SYSCALL = {"x86_64": 323, "aarch64": 282}
"""``userfaultfd``'s system call number by machine."""


def _iowr(kind: int, nr: int, size: int) -> int:
    """An ``_IOWR`` request number (read and write, ``size`` bytes of argument)."""
    return (3 << 30) | (size << 16) | (kind << 8) | nr


UFFDIO_API, UFFDIO_REGISTER, UFFDIO_WRITEPROTECT = _iowr(0xAA, 0x3F, 24), _iowr(0xAA, 0x00, 32), _iowr(0xAA, 0x06, 24)
UFFDIO_UNREGISTER = (2 << 30) | (16 << 16) | (0xAA << 8) | 0x01  # _IOR: the kernel only reads the range
PAGEMAP_SCAN = _iowr(ord("f"), 16, 96)
UFFD_API, USER_MODE_ONLY, REGISTER_WP = 0xAA, 1, 2
WP_UNPOPULATED, WP_ASYNC = 1 << 13, 1 << 15
PAGE_IS_WRITTEN, WP_MATCHING, CHECK_WPASYNC = 1 << 1, 1 << 0, 1 << 1
VEC = 8
"""Regions one ``PAGEMAP_SCAN`` may return: one written page is enough to know."""


class Kernel:
    """The two system calls, with their errors as ``OSError``."""

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long
        self.libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)

    def userfaultfd(self) -> int:
        fd = self.libc.syscall(SYSCALL[platform.machine()], os.O_CLOEXEC | os.O_NONBLOCK | USER_MODE_ONLY)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        return fd

    def ioctl(self, fd: int, request: int, *words: int) -> tuple[int, ctypes.Array]:
        arg = (ctypes.c_uint64 * len(words))(*words)
        ret = self.libc.ioctl(fd, request, ctypes.addressof(arg))
        if ret < 0:
            raise OSError(ctypes.get_errno(), f"ioctl {request:#x}")
        return ret, arg


_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ *(.*)$", re.M)
"""A ``/proc/self/maps`` line: start, end, permissions, (offset, device, inode), name."""


def private_anonymous(perms: str, name: str) -> bool:
    """Memory only this process's own writes can change (a mapping's permissions and name)."""
    return perms == "rw-p" and (name in ("", "[heap]") or name.startswith("[anon:"))


def mappings() -> tuple[list[int], list[tuple[int, int, bool]]]:
    """This process's mappings in address order: their starts, and (start, end, private anonymous)."""
    with open("/proc/self/maps") as f:
        spans = [(int(m[1], 16), int(m[2], 16), private_anonymous(m[3], m[4])) for m in _MAPS_LINE.finditer(f.read())]
    return [s[0] for s in spans], spans


def close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
