"""The kernel interface of write tracking (``pages``): userfaultfd in asynchronous write-protect
mode, ``PAGEMAP_SCAN`` on ``/proc/self/pagemap``, and which mappings are private anonymous memory
(``PROCMAP_QUERY`` where the kernel answers it, else ``/proc/self/maps`` read whole). Linux's
request numbers and flags, called through ctypes (no compiled extension); every failure is an
``OSError`` the caller turns into reading the tensors instead.
"""

from __future__ import annotations

import bisect
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
PROCMAP_QUERY = _iowr(ord("f"), 17, 104)
_RWXS, _RW = 0xF, 0x3
"""``PROCMAP_QUERY``'s permission bits (readable, writable, executable, shared), and read-write."""


def private_anonymous(perms: str, name: str) -> bool:
    """Memory only this process's own writes can change (a mapping's permissions and name)."""
    return perms == "rw-p" and _anonymous_name(name)


def _anonymous_name(name: str) -> bool:
    return name in ("", "[heap]") or name.startswith("[anon:")


def mappings() -> tuple[list[int], list[tuple[int, int, bool]]]:
    """This process's mappings in address order: their starts, and (start, end, private anonymous)."""
    with open("/proc/self/maps") as f:
        spans = [(int(m[1], 16), int(m[2], 16), private_anonymous(m[3], m[4])) for m in _MAPS_LINE.finditer(f.read())]
    return [s[0] for s in spans], spans


class Listed:
    """Which mappings hold a range, from ``/proc/self/maps`` read whole (any Linux; about 1 ms for
    a process with torch loaded), kept until ``forget``."""

    fds: tuple[int, ...] = ()

    def __init__(self):
        self._maps: tuple[list[int], list[tuple[int, int, bool]]] | None = None

    def forget(self) -> None:
        self._maps = None

    def within(self, lo: int, hi: int) -> list[tuple[int, int, bool]] | None:
        """The mappings covering ``[lo, hi)`` (start, end, True), if all private anonymous and without
        a gap; else None."""
        if self._maps is None:
            self._maps = mappings()
        starts, spans = self._maps
        i = bisect.bisect_right(starts, lo) - 1
        out, at = [], lo
        while 0 <= i < len(spans) and at < hi:
            vma = spans[i]
            if not (vma[0] <= at < vma[1] and vma[2]):
                return None
            out.append(vma)
            at, i = vma[1], i + 1
        return out if at >= hi else None


class Queried:
    """Which mappings hold a range, asked of the kernel one mapping at a time (``PROCMAP_QUERY``
    on ``/proc/self/maps``, Linux 6.11+: about 3 microseconds a question, where reading the whole
    list costs a millisecond or more); the last answer is kept until ``forget`` (a save's
    tensors lie mostly in a few mappings). Raises ``OSError`` where the kernel does not answer."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.fds = (os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC),)
        self._arg = (ctypes.c_uint64 * 13)()
        self._name = ctypes.create_string_buffer(256)
        self._last: tuple[int, int, bool] | None = None
        try:
            if self._ask(ctypes.addressof(self._arg)) is None:
                raise OSError(0, "PROCMAP_QUERY found no mapping for its own memory")
        except OSError:
            close(*self.fds)
            raise

    def forget(self) -> None:
        self._last = None

    def _ask(self, address: int) -> tuple[int, int, bool] | None:
        """The mapping holding ``address`` (None: none does); ``OSError`` if the kernel refuses."""
        arg = self._arg
        ctypes.memset(arg, 0, ctypes.sizeof(arg))
        arg[0], arg[2], arg[10], arg[11] = ctypes.sizeof(arg), address, len(self._name), ctypes.addressof(self._name)
        if self.kernel.libc.ioctl(self.fds[0], PROCMAP_QUERY, ctypes.addressof(arg)) < 0:
            errno = ctypes.get_errno()
            if errno in (2, 36):  # ENOENT: unmapped; ENAMETOOLONG: a long file name, so no anonymous memory
                return None if errno == 2 else (address, address + 1, False)
            raise OSError(errno, "PROCMAP_QUERY")
        size = arg[10] & 0xFFFFFFFF
        name = self._name.raw[:max(0, size - 1)].decode(errors="replace")
        private = arg[5] & _RWXS == _RW and arg[8] == 0 and arg[9] == 0 and _anonymous_name(name)
        return arg[3], arg[4], private

    def within(self, lo: int, hi: int) -> list[tuple[int, int, bool]] | None:
        """As ``Listed.within``; a kernel error counts as no answer (the caller reads the tensor)."""
        out, at = [], lo
        while at < hi:
            vma = self._last
            if vma is None or not vma[0] <= at < vma[1]:
                try:
                    vma = self._ask(at)
                except OSError:
                    return None
                if vma is None:
                    return None
                self._last = vma
            if not vma[2]:
                return None
            out.append(vma)
            at = vma[1]
        return out


def mapping_lookup(kernel: Kernel) -> Listed | Queried:
    """The kernel's answers where it gives them, else the whole list read."""
    try:
        return Queried(kernel)
    except (OSError, AttributeError):
        return Listed()


def close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
