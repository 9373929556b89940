"""The kernel's write tracking for asynchronous saves (``checkpoint/background/pages.py``): a
deferred host tensor's pages are write-protected at the call and asked about after the copy.

A failure means a write after the call could reach a checkpoint unseen (a page not protected, a
scan that misses a write, an edge byte nobody reads), a write to a neighbouring tensor fails a
save it does not concern, memory another process can change is trusted to the page flags, or the
protections outlive the save (every later write would fault). One process; where the machine
gives no write tracking (``PageWatch.open()`` is None: not Linux 6.7+, or a sandbox refusing
userfaultfd) the tests that need it are skipped, and the last test shows the CRC32 path catching
the same edits.
"""

import ctypes
import logging
import mmap
import os
import platform
import threading

import pytest
import torch

from modelparallel.checkpoint.background import uffd
from modelparallel.checkpoint.background.pages import PAGE, PageWatch
from modelparallel.checkpoint.background.stager import StagedTensorChanged, Stager

def _watch() -> PageWatch | None:
    """A watch for every save size (these tests' tensors are under the per-save floor)."""
    watch = PageWatch.open()
    if watch is not None:
        watch.min_save_bytes = 0
    return watch


WATCH = _watch()
needs_watch = pytest.mark.skipif(WATCH is None, reason="no asynchronous write-protect on this machine")


def _kernel_offers_it() -> bool:
    """Asked of the kernel directly, not through the code under test: a userfaultfd whose
    handshake grants asynchronous write-protect (and write-protect of unpopulated pages), and a
    pagemap that answers PAGEMAP_SCAN."""
    number = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
    if number is None or not os.path.exists("/proc/self/pagemap"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
    fd = libc.syscall(number, os.O_CLOEXEC | 1)  # 1: user-mode faults only (allowed unprivileged)
    if fd < 0:
        return False
    try:
        api = (ctypes.c_uint64 * 3)(0xAA, (1 << 15) | (1 << 13), 0)
        if libc.ioctl(fd, (3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F, ctypes.addressof(api)) < 0:
            return False
    finally:
        os.close(fd)
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        scan = (ctypes.c_uint64 * 12)(96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)  # an empty range
        return libc.ioctl(pagemap, (3 << 30) | (96 << 16) | (ord("f") << 8) | 16, ctypes.addressof(scan)) >= 0
    finally:
        os.close(pagemap)


def test_write_tracking_is_used_wherever_the_kernel_offers_it():
    assert (PageWatch.open() is not None) == _kernel_offers_it(), (
        "PageWatch.open() disagrees with the kernel: a probe that fails on a kernel offering write tracking "
        "(every save would read its tensors), or one that trusts a kernel that does not")


def _edits(t: torch.Tensor) -> dict:
    """Ways to write one element of ``t`` that its version counter does not see, by position."""
    n = t.numel()
    return {
        "data, first element": lambda: t.data[0].add_(1),
        "numpy, middle page": lambda: t.detach().numpy().__setitem__(n // 2, 7.0),
        "memset, last element": lambda: _flip_byte(t.data_ptr() + (n - 1) * t.element_size()),
        "another thread": lambda: _in_thread(lambda: t.data[n // 3].mul_(3)),
    }


def _flip_byte(address: int) -> None:
    """A raw write of one byte, always a change (its complement)."""
    ctypes.memset(address, ~ctypes.c_ubyte.from_address(address).value & 0xFF, 1)


def _in_thread(fn) -> None:
    worker = threading.Thread(target=fn)
    worker.start()
    worker.join()


def _stager(watch) -> Stager:
    stager = Stager()
    stager.pages = watch
    stager.begin()  # as every save's staging does
    return stager


def _defer(stager: Stager, name: str, t: torch.Tensor) -> torch.Tensor:
    buf = stager.buffer((name,), t)
    stager.defer(name, t, t, buf)
    return buf


@needs_watch
def test_every_write_after_the_call_is_seen_and_reads_are_not():
    for what in _edits(torch.zeros(1)):
        t = torch.randn(200_000)
        WATCH.start()
        mark = WATCH.claim(t)
        assert mark is not None and mark.hi - mark.lo >= PAGE, "an 800 kB tensor is watched"
        assert WATCH.protect_claimed() == []
        edges = mark.edges(t)
        t.sum(), t.clone(), t.detach().numpy().copy()
        assert not mark.written(), "reads were taken for writes"
        _edits(t)[what]()
        inside = mark.lo <= _written_address(t, what) < mark.hi
        seen = mark.written() if inside else mark.edges(t) != edges
        WATCH.release()
        assert seen, f"{what}: a write {'to a protected page' if inside else 'to an edge byte'} was missed"


@needs_watch
def test_pages_never_touched_or_still_protected_are_watched_too():
    """Memory no write has populated yet (a fresh mapping) and pages an unfinished protection
    still covers are protected like the rest: the first write to either is seen."""
    area = mmap.mmap(-1, 256 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(area, dtype=torch.uint8)
    t[: 8 * PAGE] = 1  # the first eight pages populated, the rest never touched
    WATCH.start()
    mark = WATCH.claim(t)
    assert WATCH.protect_claimed() == []
    WATCH._protect(mark.lo, mark.lo + 4 * PAGE)  # protected twice: still one protection
    assert not mark.written(), "nothing was written"
    for page in (2, 200):  # a populated page and a page the write populates
        WATCH.release()
        WATCH.start()
        mark = WATCH.claim(t)
        assert WATCH.protect_claimed() == [] and not mark.written()
        t[page * PAGE + 5] = 9
        assert mark.written(), f"a write to page {page} was missed"
        assert not WATCH.written(mark.lo + (page + 1) * PAGE, mark.hi), "a write was seen where none happened"
    WATCH.release()
    del t
    area.close()


def _written_address(t: torch.Tensor, what: str) -> int:
    n = t.numel()
    index = {"data, first element": 0, "numpy, middle page": n // 2, "memset, last element": n - 1,
             "another thread": n // 3}[what]
    return t.data_ptr() + index * t.element_size()


@needs_watch
def test_the_stager_names_a_tensor_written_before_its_copy_and_keeps_the_rest():
    for what in _edits(torch.zeros(1)):
        stager = _stager(WATCH)
        a, b = torch.randn(200_000), torch.randn(280_000)
        want_b = b.clone()
        _defer(stager, "a", a)
        buf_b = _defer(stager, "b", b)
        stager.seal()
        assert all(d.pages is not None for d in stager.deferred), "both tensors are watched, not read"
        _edits(a)[what]()
        with pytest.raises(StagedTensorChanged, match=r"1 tensor\(s\) .* a\. "):
            stager.copy_deferred()
        assert torch.equal(buf_b, want_b), what
        assert WATCH.protected == [], "protections outlived the save"


@needs_watch
def test_a_neighbour_sharing_a_page_does_not_fail_the_save_but_the_shared_bytes_are_checked():
    flat = torch.randn(600_000)
    cut = 280_000 + 7  # not on a page boundary: the two halves share a page
    a, b = flat[:cut], flat[cut:]
    stager = _stager(WATCH)
    want = a.clone()
    buf = _defer(stager, "a", a)
    stager.seal()
    b.data[0] = 5.0  # the neighbour, on a's last (shared) page
    stager.copy_deferred()
    assert torch.equal(buf, want), "a write to the neighbour changed the copy"
    stager.begin()
    _defer(stager, "a", a)
    stager.seal()
    a.data[-1] = 5.0  # a's own byte on the shared page: not protected, read at the call instead
    with pytest.raises(StagedTensorChanged, match="a"):
        stager.copy_deferred()


@needs_watch
def test_a_save_under_the_floor_reads_its_tensors():
    watch = PageWatch.open()
    stager = _stager(watch)
    t = torch.randn(200_000)
    _defer(stager, "t", t)
    assert stager.deferred[0].pages is not None, "claimed at the defer"
    stager.seal()
    assert stager.deferred[0].pages is None and watch.protected == [], "800 kB in all: read, not protected"
    t.data[100_000] += 1
    with pytest.raises(StagedTensorChanged, match="t"):
        stager.copy_deferred()


@needs_watch
def test_memory_another_process_can_write_is_read_not_watched():
    shared = torch.randn(200_000).share_memory_()
    small = torch.randn(100)
    assert not WATCH.eligible(shared), "shared memory changes without this process's page tables"
    assert not WATCH.eligible(small) and not WATCH.eligible(torch.randn(400, 400).t())
    stager = _stager(WATCH)
    _defer(stager, "shared", shared)
    stager.seal()
    assert stager.deferred[0].pages is None
    shared.detach().numpy()[123] += 1
    with pytest.raises(StagedTensorChanged, match="shared"):
        stager.copy_deferred()


@needs_watch
def test_protections_end_with_the_copy_and_with_an_abandoned_save():
    t = torch.randn(200_000)
    stager = _stager(WATCH)
    _defer(stager, "t", t)
    stager.seal()
    mark = stager.deferred[0].pages
    assert not mark.written()
    stager.copy_deferred()
    assert mark.written(), "the page flags are still set after the copy: the next step would fault per page"
    assert WATCH._registered, "the registrations end after the step is released (settle), not with the copy"
    stager.settle()
    assert WATCH._registered == []
    stager.begin()
    _defer(stager, "t", t)
    stager.seal()
    mark = stager.deferred[0].pages
    stager.abandon()
    assert mark.written() and stager.deferred == [] and WATCH.protected == [] and WATCH._registered == []


def test_without_write_tracking_the_call_reads_the_tensors_and_catches_the_same_edits(monkeypatch):
    def refused(self):
        raise OSError(1, "userfaultfd (refused by the sandbox)")

    monkeypatch.setattr(uffd.Kernel, "userfaultfd", refused)
    stager = Stager()
    assert stager.pages is None, "a refused userfaultfd must leave the CRC32 path"
    for what in _edits(torch.zeros(1)):
        t = torch.randn(200_000)
        _defer(stager, "t", t)
        assert stager.deferred[0].pages is None and stager.deferred[0].crc is not None
        _edits(t)[what]()
        with pytest.raises(StagedTensorChanged, match="t"):
            stager.copy_deferred()


@needs_watch
def test_two_savers_in_one_process_take_turns_with_the_same_memory():
    """A v1 saver and a v2 queue (or a job started again) each have a watch; a mapping belongs
    to one watch only while that watch's save stages, so each save is watched, not read."""
    t = torch.randn(200_000)
    for stager in (_stager(_watch()), _stager(_watch()), _stager(_watch())):
        _defer(stager, "t", t)
        stager.seal()
        assert stager.deferred[0].pages is not None, "the memory was still held by another saver's watch"
        t.data[25_000] += 1
        with pytest.raises(StagedTensorChanged, match="t"):
            stager.copy_deferred()
        stager.settle()  # as the background thread does once the step is released


@needs_watch
def test_memory_another_savers_save_holds_is_read_instead():
    t = torch.randn(200_000)
    first, second = _stager(_watch()), _stager(_watch())
    _defer(first, "t", t)
    first.seal()
    _defer(second, "t", t)
    second.seal()
    assert first.deferred[0].pages is not None and second.deferred[0].pages is None, "refused: read instead"
    t.data[25_000] += 1
    for stager in (first, second):
        with pytest.raises(StagedTensorChanged, match="t"):
            stager.copy_deferred()
        stager.settle()


def test_a_failed_probe_closes_its_descriptors_once(monkeypatch):
    """The descriptor numbers are free again once closed: a file opened meanwhile (here by a log
    handler, as a ``FileHandler(delay=True)`` does at its first record) must stay open."""
    opened = []

    class Opens(logging.Handler):
        def emit(self, record):
            opened.append(os.open(os.devnull, os.O_RDONLY))

    def refused(self):
        raise OSError(0, "probe gave wrong pages")

    monkeypatch.setattr(PageWatch, "_probe", refused)
    log, handler = logging.getLogger("modelparallel"), Opens(logging.DEBUG)
    level, propagate = log.level, log.propagate
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    log.propagate = False  # pytest's handlers keep the record, the error, its frame and the watch in it
    try:
        assert PageWatch.open() is None
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
    assert opened, "the refusal was not logged"
    for fd in opened:
        os.fstat(fd)  # EBADF: closed by the failed watch's finalizer
        os.close(fd)
