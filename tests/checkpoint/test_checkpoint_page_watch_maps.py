"""Which memory the write tracking trusts (``checkpoint/background/uffd.py``): only private
anonymous memory, whose bytes nothing but this process's own writes can change.

The kernel is asked one mapping at a time (``Queried``, ``PROCMAP_QUERY``) where it answers, else
the whole list is read (``Listed``). A failure means a mapping another process or a file can change
is trusted to the page flags (a write there would reach a checkpoint unseen), or memory that could
be watched is read at every save. The answers are checked against ``/proc/self/maps`` parsed here,
not by the code under test.
"""

import ctypes
import mmap
import os
import re
import tempfile

import numpy as np
import pytest
import torch

from modelparallel.checkpoint.background import uffd
from modelparallel.checkpoint.background.pages import PAGE, PageWatch

LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) (\S+) (\S+) (\d+) *(.*)$")


def _listed_here() -> list[tuple[int, int, bool]]:
    """(start, end, trusted) per mapping: read-write, private, no file (inode 0), and named as
    anonymous memory is ("", "[heap]", "[anon:...]")."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            m = LINE.match(line.rstrip("\n"))
            name = m[7].strip()
            trusted = m[3] == "rw-p" and m[6] == "0" and (name in ("", "[heap]") or name.startswith("[anon:"))
            out.append((int(m[1], 16), int(m[2], 16), trusted))
    return out


def _want(lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` lies in trusted mappings only, without a gap (by the list read here)."""
    at = lo
    for start, end, trusted in _listed_here():
        if start <= at < end:
            if not trusted:
                return False
            at = end
            if at >= hi:
                return True
    return False


def _queried():
    try:
        return uffd.Queried(uffd.Kernel())
    except OSError:
        return None


QUERIED = _queried()


def _memories(stack):
    """(what, address, length) of memory of every kind a tensor can live in."""
    big = torch.randn(300_000)
    small = torch.randn(64)
    shared = torch.randn(300_000).share_memory_()
    anon_shared = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    handle = tempfile.TemporaryFile()
    handle.write(b"\0" * 64 * PAGE)
    handle.flush()
    file_private = mmap.mmap(handle.fileno(), 64 * PAGE, flags=mmap.MAP_PRIVATE)
    # two private mappings side by side with different permissions: a range over both is two mappings
    pair = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pair_at = np.frombuffer(pair, dtype=np.uint8).ctypes.data
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(pair_at + 4 * PAGE, 4 * PAGE, mmap.PROT_READ) == 0
    stack.extend([big, small, shared, anon_shared, handle, file_private, pair])
    address = lambda area: np.frombuffer(area, dtype=np.uint8).ctypes.data  # noqa: E731
    return [("private anonymous (a large tensor)", big.data_ptr(), big.nbytes),
            ("the heap (a small tensor)", small.data_ptr(), small.nbytes),
            ("shared memory (share_memory_)", shared.data_ptr(), shared.nbytes),
            ("shared anonymous", address(anon_shared), 64 * PAGE),
            ("a private file mapping", address(file_private), 64 * PAGE),
            ("read-write half of a pair", pair_at, 4 * PAGE),
            ("over both halves of a pair", pair_at, 8 * PAGE),
            ("unmapped", 4096, PAGE)]


@pytest.mark.parametrize("lookup", ["queried", "listed"])
def test_only_private_anonymous_memory_is_trusted(lookup):
    if lookup == "queried" and QUERIED is None:
        pytest.skip("this kernel does not answer PROCMAP_QUERY (Linux 6.11+): the list is read instead")
    maps = QUERIED if lookup == "queried" else uffd.Listed()
    keep, trusted = [], []
    for what, lo, length in _memories(keep):
        maps.forget()
        got = maps.within(lo, lo + length) is not None
        assert got == _want(lo, lo + length), f"{lookup}: {what} {'trusted' if got else 'not trusted'} wrongly"
        trusted += [what] if got else []
    assert trusted[0] == "private anonymous (a large tensor)" and "read-write half of a pair" in trusted, trusted


def test_the_kernel_is_asked_wherever_it_answers():
    """On a kernel with ``PROCMAP_QUERY`` the watch asks it (no list read per save) and watches saves
    from 8 MiB; elsewhere it reads the list and watches saves from 64 MiB."""
    watch = PageWatch.open()
    if watch is None:
        pytest.skip("no write tracking on this machine")
    if QUERIED is None:
        assert isinstance(watch.maps, uffd.Listed) and watch.min_save_bytes == 1 << 26
    else:
        assert isinstance(watch.maps, uffd.Queried) and watch.min_save_bytes == 1 << 23


def test_a_kernel_refusing_the_question_falls_back_to_the_list(monkeypatch):
    kernel = uffd.Kernel()

    class Refusing:
        def __getattr__(self, name):
            return getattr(kernel.libc, name)

        @staticmethod
        def ioctl(fd, request, arg):
            if request == uffd.PROCMAP_QUERY:
                ctypes.set_errno(25)  # ENOTTY: a kernel before 6.11
                return -1
            return kernel.libc.ioctl(fd, request, arg)

    kernel.libc = Refusing()
    before = set(os.listdir("/proc/self/fd"))
    assert isinstance(uffd.mapping_lookup(kernel), uffd.Listed)
    assert set(os.listdir("/proc/self/fd")) <= before, "the refused lookup left its descriptor open"
