"""Which pages of host memory were written since a moment, told by the kernel, not by reading them.

An asynchronous save leaves the copy of what only the optimizer's step changes to its background
thread, so it must know whether anything wrote those bytes between the call and the copy, by any
means (``p.data``, a numpy view, another thread: the version counter sees none of these). Reading
the bytes at the call (a CRC32) answers that but costs a pass over them in the call (3-7% of a
synchronous save on the machine measured). Linux (6.7 and later) answers it for a page-table
walk: memory registered with a userfaultfd in asynchronous write-protect mode can be write-
protected (``protect``: a flag per page table entry, nothing copied, nothing read), every later
write clears that page's flag without stopping the writer, and ``PAGEMAP_SCAN`` lists the pages
whose flag is gone (``written``). After the copy the flags are cleared (``release``) so the
optimizer's step pays no fault per page.

Only whole pages a tensor's bytes cover alone are protected; the bytes it shares a page with
other memory (at most a page's worth at each end) are still read at the call (``Protected``), so a
write to a neighbour is never taken for a write to the tensor. Only private anonymous memory is
watched (the heap, ``malloc``'s own mappings), not pinned for a GPU: a file or shared mapping
can change without a write through this process's page tables, and a device writes pinned memory
by DMA. Where the kernel, the architecture or a sandbox
refuses any step (``open`` returns None), the caller reads the bytes as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import sys
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ...host_bytes import host_bytes
from ..safety.crc import crc32
from . import uffd as abi
from .runs import cut

logger = logging.getLogger("modelparallel")

PAGE = mmap.PAGESIZE
MIN_BYTES = 1 << 19
"""Smaller tensors are protected only beside larger ones (in their walk, ``runs``), else read at
the call. A walk of its own costs about 15 microseconds (system call, TLB flush) plus 30-45 ns per
page on the 2-core VM measured, a CRC32 150-250 ns per page (16-27 GB/s; slower from memory, as
after a training step): protecting alone pays from a few hundred kilobytes up, in a neighbour's
walk from three pages (a whole page inside)."""
MIN_SAVE_BYTES = 1 << 26
"""A save deferring fewer bytes is read at the call, where the process's mappings are read whole
(``uffd.Listed``): that and the registrations (about 2 ms) cost as much as reading 64 MiB at 27 GB/s."""
MIN_SAVE_BYTES_QUERIED = 1 << 23
"""The same floor where the kernel answers for one mapping at a time (``uffd.Queried``, Linux 6.11+):
protecting 8 MiB in 8 tensors took 0.15 ms against 0.20 ms to read them (2-core VM)."""


class PageWatch:
    """A userfaultfd in asynchronous write-protect mode and this process's pagemap, with the
    ranges protected by the save in progress (``release`` clears them)."""

    def __init__(self, kernel: abi.Kernel, uffd: int, pagemap: int, maps: abi.Listed | abi.Queried | None = None):
        self.kernel, self.uffd, self.pagemap = kernel, uffd, pagemap
        self.protected: list[tuple[int, int]] = []
        self.min_bytes, self.min_save_bytes = MIN_BYTES, MIN_SAVE_BYTES
        self.maps = maps if maps is not None else abi.Listed()
        """Which mappings hold a tensor (``uffd.Queried`` where the kernel answers, else the list read)."""
        if isinstance(self.maps, abi.Queried):
            self.min_save_bytes = MIN_SAVE_BYTES_QUERIED
        self._claimed: list[Protected] = []
        self._registered: list[tuple[int, int]] = []
        """Spans registered for the save in progress: only for its duration (``unregister``), so
        another watch in the process (another saver's) can register them for its own saves."""
        self._reread = False
        self._vec = (ctypes.c_uint64 * (3 * abi.VEC))()
        self._closer = weakref.finalize(self, abi.close, uffd, pagemap, *self.maps.fds)

    @classmethod
    def open(cls) -> PageWatch | None:
        """A watch, or None where this machine cannot give one (logged once at debug level)."""
        if sys.platform != "linux" or platform.machine() not in abi.SYSCALL:
            return None
        fds: list[int] = []
        watch = None
        try:
            kernel = abi.Kernel()
            fds.append(kernel.userfaultfd())
            _, api = kernel.ioctl(fds[0], abi.UFFDIO_API, abi.UFFD_API, abi.WP_ASYNC | abi.WP_UNPOPULATED, 0)
            if api[1] & (abi.WP_ASYNC | abi.WP_UNPOPULATED) != abi.WP_ASYNC | abi.WP_UNPOPULATED:
                raise OSError(0, "no asynchronous write-protect")
            fds.append(os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC))
            watch = cls(kernel, *fds, abi.mapping_lookup(kernel))
            watch._probe()
            return watch
        except (OSError, AttributeError, KeyError) as e:
            if watch is not None:  # its finalizer owns them: closing them here too would close their next owner's
                watch._closer()
            else:
                abi.close(*fds)
            logger.debug("write tracking unavailable (%s): asynchronous saves read deferred tensors at the call", e)
            return None

    def _probe(self) -> None:
        """Protect two pages of a fresh mapping, write the second: exactly it must show."""
        area = mmap.mmap(-1, 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = np.frombuffer(area, dtype=np.uint8)
        try:
            lo = view.ctypes.data
            self.kernel.ioctl(self.uffd, abi.UFFDIO_REGISTER, lo, 2 * PAGE, abi.REGISTER_WP, 0)
            view[:] = 1
            self._protect(lo, lo + 2 * PAGE)
            view[PAGE] = 2
            if self.written(lo, lo + PAGE) or not self.written(lo + PAGE, lo + 2 * PAGE):
                raise OSError(0, "write tracking probe gave wrong pages")
            self._protect(lo, lo + 2 * PAGE, on=False)
        finally:
            del view
            area.close()

    def start(self) -> None:
        """Begin a save: clear what an earlier one left; the process's mappings are read again at
        the first question (and kept until ``release``: the saved tensors exist throughout)."""
        self.release()
        self.unregister()
        self._claimed.clear()
        self.maps.forget()
        self._reread = False

    def eligible(self, t: torch.Tensor) -> bool:
        """Whether ``claim`` takes ``t`` to be protected alone and its memory is private anonymous
        (the rest of ``protect_claimed``'s test, which reads the process's mappings)."""
        return self._watchable(t, self.min_bytes) and self._covering(t.data_ptr(), t.data_ptr() + t.nbytes) is not None

    def _watchable(self, t: torch.Tensor, floor: int) -> bool:
        """A contiguous host tensor of ``floor`` bytes or more (and three pages at least: a whole
        page inside), not pinned for a GPU (a copy from the device writes it by DMA, past the
        page tables)."""
        if not t.is_cpu or not t.is_contiguous() or t.nbytes < max(floor, 3 * PAGE):
            return False
        return not (torch.cuda.is_initialized() and t.is_pinned())  # nothing is pinned before CUDA starts

    def _covering(self, lo: int, hi: int) -> list[tuple[int, int, bool]] | None:
        """The mappings that hold ``[lo, hi)``, if all private anonymous and without a gap (on a
        miss the mappings are read again, once per save: memory mapped since they were read)."""
        found = self.maps.within(lo, hi)
        if found is None and not self._reread:
            self.maps.forget()
            self._reread = True
            found = self.maps.within(lo, hi)
        return found

    def claim(self, t: torch.Tensor) -> Protected | None:
        """``t``'s mark, to be protected by ``protect_claimed`` at the end of the call's staging
        (the mappings read and registered once then); None (the caller reads ``t``) if it is too
        small or pinned. Under ``min_bytes`` the mark is protected only in a larger one's walk."""
        if not self._watchable(t, 0):
            return None
        start = t.data_ptr()
        end = start + t.nbytes
        lo, hi = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        mark = Protected(self, lo, hi, lo - start, end - hi, t.nbytes >= self.min_bytes)
        self._claimed.append(mark)
        return mark

    def protect_claimed(self) -> list[Protected]:
        """Register, per mapping, the span of the claimed pages in it, and write-protect them;
        the marks not protected (the caller reads those tensors instead): all of them when they
        total less than ``min_save_bytes``, those outside private anonymous memory, those the
        kernel refused."""
        claimed, self._claimed = sorted(self._claimed, key=lambda m: m.lo), []
        if sum(m.hi - m.lo for m in claimed) < self.min_save_bytes:
            return claimed
        self.maps.forget()  # not ``eligible``'s answers: a file mapped since where they saw the heap
        self._reread = True
        located = [(mark, self._covering(mark.lo - mark.head, mark.hi + mark.tail)) for mark in claimed]
        runs = cut(located)  # neighbours in one walk (``runs``)
        spans: dict[tuple[int, int], list[int]] = {}
        for run in runs:
            for vma, lo, hi in run.spans() if run.alone else ():
                span = spans.setdefault(vma, [lo, hi])
                span[0], span[1] = min(span[0], lo), max(span[1], hi)
        refused: set[tuple[int, int]] = set()
        for vma, (lo, hi) in spans.items():
            try:
                self.kernel.ioctl(self.uffd, abi.UFFDIO_REGISTER, lo, hi - lo, abi.REGISTER_WP, 0)
                self._registered.append((lo, hi))
            except OSError as e:  # another watch holds it (another saver's save), or the kernel refuses
                logger.debug("write tracking: registering %#x-%#x refused (%s)", lo, hi, e)
                refused.add(vma)
        failed = [mark for mark, vmas in located if vmas is None]
        for run in runs:
            try:
                if not run.alone:  # small tensors only: reading them costs less than a walk
                    raise OSError(0, "small tensors only")
                if any(vma[:2] in refused for vma in run.vmas):
                    raise OSError(0, "a mapping of it not registered")
                self._protect(run.lo, run.hi)
                self.protected.append((run.lo, run.hi))
            except OSError as e:
                logger.debug("write tracking not used for %#x-%#x (%s): read at the call instead", run.lo, run.hi, e)
                failed.extend(run.marks)
        return failed

    def _protect(self, lo: int, hi: int, on: bool = True) -> None:
        """Write-protect ``[lo, hi)`` (``on``) by ``PAGEMAP_SCAN``'s protect-while-walking, with no
        output asked: 3-4x faster per page than ``UFFDIO_WRITEPROTECT`` on the VM measured
        (``bench/bench_write_protect.py``: 466 MB in 4.3 ms against 16.0 ms); clearing has only
        the latter."""
        if on:
            _, arg = self.kernel.ioctl(self.pagemap, abi.PAGEMAP_SCAN, 96, abi.WP_MATCHING | abi.CHECK_WPASYNC, lo, hi,
                                       0, 0, 0, 0, 0, abi.PAGE_IS_WRITTEN, 0, abi.PAGE_IS_WRITTEN)
            if arg[4] < hi:  # the walk stopped short (its ``walk_end``): the rest is not protected
                raise OSError(0, f"write-protecting stopped at {arg[4]:#x} of {lo:#x}-{hi:#x}")
        else:
            self.kernel.ioctl(self.uffd, abi.UFFDIO_WRITEPROTECT, lo, hi - lo, 0)

    def written(self, lo: int, hi: int) -> bool:
        """Whether any page of ``[lo, hi)`` was written since it was protected (an error reading
        the flags counts as written: a save is never trusted on a question the kernel did not answer)."""
        try:
            found, _ = self.kernel.ioctl(self.pagemap, abi.PAGEMAP_SCAN, 96, abi.CHECK_WPASYNC, lo, hi, 0,
                                         ctypes.addressof(self._vec), abi.VEC, 1, 0, abi.PAGE_IS_WRITTEN, 0,
                                         abi.PAGE_IS_WRITTEN)
        except OSError as e:
            logger.debug("write tracking scan of %#x-%#x failed (%s)", lo, hi, e)
            return True
        return found > 0

    def release(self) -> None:
        """Clear every protection of the save in progress (after its copies: the optimizer's step
        then pays no fault per page)."""
        ranges, self.protected = self.protected, []
        self.maps.forget()  # asked again by the next save: memory may be mapped and unmapped meanwhile
        for lo, hi in ranges:
            self._quietly(abi.UFFDIO_WRITEPROTECT, lo, hi - lo, 0)

    def unregister(self) -> None:
        """End the save's registrations (after the step was released: walking the spans again
        takes the process's memory map lock for a while)."""
        spans, self._registered = self._registered, []
        for lo, hi in spans:
            self._quietly(abi.UFFDIO_UNREGISTER, lo, hi - lo)

    def _quietly(self, request: int, *words: int) -> None:
        try:
            self.kernel.ioctl(self.uffd, request, *words)
        except OSError as e:  # the memory was unmapped since: nothing left to clear
            logger.debug("write tracking: %#x over %#x-%#x failed (%s)", request, words[0], words[0] + words[1], e)


@dataclass
class Protected:
    """A tensor watched by ``PageWatch``: its whole pages ``[lo, hi)`` protected, and the ``head``
    and ``tail`` bytes it shares pages with other memory, whose CRC32 the caller takes."""

    watch: PageWatch
    lo: int
    hi: int
    head: int
    tail: int
    alone: bool = True
    """Large enough to be protected by a walk of its own (``MIN_BYTES``)."""

    def edges(self, t: torch.Tensor) -> int:
        """CRC32 of ``t``'s bytes outside the protected pages (``t``: the tensor or its copy, a
        contiguous host tensor: read through its address, as ``host_bytes`` does, without making
        a view of all of it for two ends)."""
        if not t.is_cpu or not t.is_contiguous():
            host_bytes(t)  # raises, naming what is wrong
        start, nbytes = t.data_ptr(), t.nbytes
        return crc32(ctypes.string_at(start + nbytes - self.tail, self.tail), crc32(ctypes.string_at(start, self.head)))

    def written(self) -> bool:
        return self.watch.written(self.lo, self.hi)
