"""Edge cases of the kernel's write tracking for asynchronous saves (``background/pages.py``), tried
through a ``Stager`` as a save uses it: defer at the call, seal, an edit, the background copy.

Each test is a way a write could reach a checkpoint unseen (memory a file or another mapping can
change, views of one storage, huge pages, a fork, writes by the kernel on the process's behalf,
mappings changed during the call) or a write elsewhere could fail a save it does not concern. The
mappings are told from ``/proc/self/maps`` read here, not by the code under test.
"""

import ctypes
import mmap
import os

import numpy as np
import pytest
import torch

from modelparallel.checkpoint.background import uffd
from modelparallel.checkpoint.background.pages import PAGE, PageWatch, Protected
from modelparallel.checkpoint.background.stager import StagedTensorChanged, Stager

WATCH = PageWatch.open()
needs_watch = pytest.mark.skipif(WATCH is None, reason="no asynchronous write-protect on this machine")


@pytest.fixture(autouse=True, params=["asked", "listed"])
def _lookup(request, monkeypatch):
    """Every case with the mappings asked of the kernel one at a time (where it answers) and with
    the whole list read (older kernels)."""
    if request.param == "listed":
        monkeypatch.setattr(uffd, "mapping_lookup", lambda kernel: uffd.Listed())
N = 300_000
"""Elements of a test tensor (1.2 MB: whole pages inside, above ``min_bytes``)."""


def _stager(watch=None) -> Stager:
    if watch is None:
        watch = PageWatch.open()
    watch.min_save_bytes = 0  # these saves are under the per-save floor
    stager = Stager()
    stager.pages = watch
    stager.begin()
    return stager


def _save(stager: Stager, edit, **tensors) -> str:
    """Defer ``tensors``, seal, ``edit()``, copy: "" or the failure's message."""
    for name, t in tensors.items():
        stager.defer(name, t, t, stager.buffer((name,), t))
    stager.seal()
    edit()
    try:
        stager.copy_deferred()
        return ""
    except StagedTensorChanged as e:
        return str(e)
    finally:
        stager.settle()


def _named(message: str) -> list[str]:
    """The tensors a failure's message names."""
    return message.split("staged: ")[1].split(". ")[0].split(", ") if message else []


def _flip(t: torch.Tensor, i: int) -> None:
    """Write element ``i`` of ``t`` so that it always changes (around the version counter)."""
    t.data[i] = -t.data[i] - 1


def _mapping(address: int) -> tuple[str, int, int, str]:
    """(permissions, start, file offset, name) of the mapping holding ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[1], lo, int(fields[2], 16), (fields[5].strip() if len(fields) > 5 else "")
    raise AssertionError(f"{address:#x} is not mapped")


def _flip_in_file(path: str, t: torch.Tensor, i: int) -> None:
    """Change element ``i`` of file-backed ``t`` through another descriptor (not its mapping)."""
    _, start, offset, _ = _mapping(t.data_ptr())
    at = t.data_ptr() + i * t.element_size() - start + offset
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)


def _file_tensors(tmp_path):
    """(path, tensor) for each way a host tensor comes to live in a file's pages."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.random.default_rng(0).random(N, dtype=np.float32).tobytes())
    st, pt = tmp_path / "w.safetensors", tmp_path / "w.pt"
    save_file({"w": torch.randn(N)}, st)
    torch.save({"w": torch.randn(N)}, pt)
    yield "from_file private", raw, torch.from_file(str(raw), shared=False, size=N, dtype=torch.float32)
    yield "from_file shared", raw, torch.from_file(str(raw), shared=True, size=N, dtype=torch.float32)
    yield "memmap r+", raw, torch.from_numpy(np.memmap(raw, dtype=np.float32, mode="r+"))
    yield "memmap copy-on-write", raw, torch.from_numpy(np.memmap(raw, dtype=np.float32, mode="c"))
    yield "safetensors load_file", st, load_file(st)["w"]
    with safe_open(st, "pt") as f:
        yield "safetensors safe_open", st, f.get_tensor("w")
    yield "torch.load mmap", pt, torch.load(pt, mmap=True)["w"]


@needs_watch
def test_a_tensor_in_a_files_pages_is_read_and_a_write_to_the_file_fails_the_save(tmp_path):
    for what, path, t in _file_tensors(tmp_path):
        assert _mapping(t.data_ptr())[3] == str(path), f"{what}: not file-backed here, the test proves nothing"
        stager = _stager()
        message = _save(stager, lambda: _flip_in_file(str(path), t, N // 2), w=t)
        assert "1 tensor(s)" in message, f"{what}: a write to the file after the call was missed"


@needs_watch
def test_memory_remapped_during_the_call_is_judged_by_its_mapping_at_the_seal(tmp_path):
    """``eligible`` (the early reads) saw private memory where a file is mapped by the time of the seal."""
    size = 4 << 20
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.random.default_rng(1).random(size // 4, dtype=np.float32).tobytes())
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    at = ctypes.addressof(ctypes.c_char.from_buffer(area))
    stager = _stager()
    stager.fingerprint_early([torch.frombuffer((ctypes.c_float * (size // 4)).from_address(at), dtype=torch.float32)])
    stager.begin()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    fd = os.open(raw, os.O_RDWR)
    try:  # the file in place of the private memory (MAP_SHARED | MAP_FIXED)
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        assert libc.mmap(ctypes.c_void_p(at), ctypes.c_size_t(size), rw, 0x11, fd, 0) == at
    finally:
        os.close(fd)
    t = torch.frombuffer((ctypes.c_float * (size // 4)).from_address(at), dtype=torch.float32)
    assert _mapping(at)[3] == str(raw)
    message = _save(stager, lambda: _flip_in_file(str(raw), t, 1000), w=t)
    stager.fingerprint_early(None)
    del t
    area.close()  # unmaps the file
    assert "1 tensor(s)" in message, "a file mapped after the early reads was watched, and a write to it missed"


@needs_watch
def test_views_of_one_storage():
    flat = torch.randn(3 * N)
    a, b = flat[:N + 7], flat[N + 7:2 * N]  # adjacent, sharing a page; neither page aligned
    assert _named(_save(_stager(), lambda: _flip(a, -1), a=a, b=b)) == ["a"], "a's byte on the shared page"
    assert _named(_save(_stager(), lambda: _flip(b, 0), a=a, b=b)) == ["b"], "b's byte on the shared page"
    assert _save(_stager(), lambda: _flip(flat, 2 * N + 3), a=a, b=b) == "", "a neighbour of neither"
    a, b = flat[:2 * N], flat[N:3 * N]  # overlapping
    assert _named(_save(_stager(), lambda: _flip(flat, N + N // 2), a=a, b=b)) == ["a", "b"]
    assert _named(_save(_stager(), lambda: _flip(flat, N // 2), a=a, b=b)) == ["a"]
    tied = flat[N:2 * N]
    assert _save(_stager(), lambda: None, a=tied, b=tied) == ""
    assert _named(_save(_stager(), lambda: _flip(tied, N // 3), a=tied, b=tied)) == ["a", "b"]
    matrix = torch.randn(800, 800)
    stager = _stager()
    want = matrix.t().clone()
    assert _save(stager, lambda: _flip(matrix, 5), t=matrix.t()) == "", "a transposed tensor is copied at the call"
    assert torch.equal(stager.buffers[("t",)], want)


def _huge_page_kb(address: int) -> int:
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _thp_offered() -> bool:
    """Transparent huge pages on request (``always`` or ``madvise``, not ``never``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@needs_watch
def test_huge_pages_a_neighbour_in_the_same_huge_page_and_a_write_inside():
    huge = 2 << 20
    area = mmap.mmap(-1, 3 * huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(area, dtype=np.uint8)
    skip = -base.ctypes.data % huge
    aligned = base[skip:skip + 2 * huge]
    asked = ctypes.CDLL(None).madvise(ctypes.c_void_p(aligned.ctypes.data), ctypes.c_size_t(2 * huge), 14) == 0
    whole = torch.from_numpy(aligned).view(torch.float32)
    for edit in ("neighbour", "inside"):
        whole.normal_()
        if edit == "neighbour" and asked and _thp_offered():  # elsewhere: the same checks on small pages
            assert _huge_page_kb(aligned.ctypes.data) > 0, "no huge page was made though the kernel offers them"
        a, b = whole[:whole.numel() // 3 + 5], whole[whole.numel() // 3 + 5:]  # a ends inside a huge page
        message = _save(_stager(), lambda: _flip(b, 3) if edit == "neighbour" else _flip(a, 1000), a=a)
        assert (message == "") == (edit == "neighbour"), edit
    spanning = torch.from_numpy(base).view(torch.float32)  # the madvise split the mapping in two or three
    if asked:
        assert _mapping(spanning.data_ptr())[1] != _mapping(spanning.data_ptr() + 4 * (spanning.numel() - 1))[1]
    for i in (10, -10):
        assert "1 tensor(s)" in _save(_stager(), lambda: _flip(spanning, i), t=spanning), "a tensor over mappings"


@needs_watch
def test_writes_by_the_kernel_and_by_a_thread_during_the_copy(monkeypatch):
    def through_proc_mem(t):
        fd = os.open("/proc/self/mem", os.O_RDWR)
        at = t.data_ptr() + 4 * (N // 2)
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
        os.close(fd)

    def read_into(t):  # a read(2) into the tensor's memory: the kernel copies to user memory
        r, w = os.pipe()
        os.write(w, (~t.detach().numpy()[N // 2: N // 2 + 4].view(np.uint8)).tobytes())
        os.readv(r, [memoryview(t.detach().numpy()[N // 2: N // 2 + 4].view(np.uint8))])
        os.close(r), os.close(w)

    for edit in (through_proc_mem, read_into):
        t = torch.randn(N)
        assert "1 tensor(s)" in _save(_stager(), lambda: edit(t), t=t), edit.__name__
    for write in (False, True):  # pages never faulted in: the kernel's markers protect them
        area = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        untouched = torch.frombuffer(area, dtype=torch.float32)
        message = _save(_stager(), lambda: _flip(untouched, 12345) if write else None, t=untouched)
        assert ("1 tensor(s)" in message) == write, "unpopulated pages: the copy's reads are not writes"
        del untouched
        area.close()
    t = torch.randn(N)
    edges = Protected.edges

    def write_after_copy(self, x):  # after the buffer was filled, before the pages are asked about
        if x is not t:
            _flip(t, N // 2)
        return edges(self, x)

    monkeypatch.setattr(Protected, "edges", write_after_copy)
    assert "1 tensor(s)" in _save(_stager(), lambda: None, t=t), "a write between the copy and the question"


@needs_watch
def test_a_fork_between_the_call_and_the_copy():
    for parent_writes in (False, True):
        t = torch.randn(N)
        want = t.clone()

        def fork():
            pid = os.fork()
            if pid == 0:  # the child writes its own copy of the pages, and leaves
                ctypes.memset(t.data_ptr() + 4 * (N // 2), 0x5A, 4)
                os._exit(0)
            os.waitpid(pid, 0)
            if parent_writes:
                _flip(t, N // 2)

        stager = _stager()
        message = _save(stager, fork, t=t)
        assert ("1 tensor(s)" in message) == parent_writes, message
        assert parent_writes or torch.equal(stager.buffers[("t",)], want)


@needs_watch
def test_pages_dropped_by_madv_dontneed_fail_the_save():
    """MADV_DONTNEED zeroes private pages without a write (not a training action): the scan counts
    a dropped page as written (its entry lost the protection with the page), before any read too."""
    t = torch.randn(N)
    page = -(-t.data_ptr() // PAGE) * PAGE + 10 * PAGE
    drop = lambda: ctypes.CDLL(None).madvise(ctypes.c_void_p(page), ctypes.c_size_t(PAGE), 4)  # noqa: E731
    stager = _stager()
    stager.defer("t", t, t, stager.buffer(("t",), t))
    stager.seal()
    drop()
    assert stager.deferred[0].pages.written(), "a dropped page, before the copy reads it"
    with pytest.raises(StagedTensorChanged, match="t"):
        stager.copy_deferred()
    stager.settle()
    assert float(t[(page - t.data_ptr()) // 4]) == 0.0, "the page was not dropped: nothing tested"


@needs_watch
def test_two_savers_at_once_an_abandoned_save_and_no_descriptor_left_open():
    import gc

    a, b = torch.randn(N), torch.randn(N)
    first, second = _stager(), _stager()
    for stager, t in ((first, a), (second, b)):
        stager.defer("t", t, t, stager.buffer(("t",), t))
        stager.seal()
        assert stager.deferred[0].pages is not None
    first.copy_deferred()
    first.settle()  # the first saver's end leaves the second's protections in place
    _flip(b, 1000)
    with pytest.raises(StagedTensorChanged):
        second.copy_deferred()
    second.settle()
    stager = _stager()
    stager.defer("t", a, a, stager.buffer(("t",), a))
    stager.seal()
    stager.abandon()
    stager.begin()
    assert not torch.cuda.is_initialized() and not a.is_pinned(), "CPU only: nothing pinned, watched"
    assert "1 tensor(s)" in _save(stager, lambda: _flip(a, 5), t=a), "the save after an abandoned one is watched"
    del first, second, stager
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(10):
        _save(_stager(), lambda: None, t=a)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before, "a watch's descriptors outlived it"
