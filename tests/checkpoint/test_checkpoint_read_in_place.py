"""What an asynchronous save reads of the training's tensors at its call (the CRC-32 of a
deferred tensor, ``deferred.fingerprint``; the bytes at the edges of its watched pages,
``pages.Mark.edges``) is read in place and leaves the tensors as they were: zlib's CRC-32 of the
same bytes, and storages that training (FSDP frees storages by resizing them) may still resize.
``Tensor.numpy()`` would mark them not resizable, for good."""

import zlib

import pytest
import torch

from modelparallel.checkpoint.background.deferred import fingerprint, host_bytes
from modelparallel.checkpoint.background.pages import PageWatch


def _resizable(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    size = storage.nbytes()
    try:
        storage.resize_(size + 8)
    except RuntimeError:
        return False
    storage.resize_(size)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
def test_fingerprint_is_zlibs_crc_of_the_bytes_and_leaves_the_storage_resizable(dtype):
    base = (torch.arange(10_001, dtype=torch.float64) * 0.37).to(dtype)
    for t in (base, base[3:], base[:0], base.view(1, -1)):
        raw = bytes(t.clone().reshape(-1).view(torch.uint8).tolist())  # a copy's bytes, one by one
        assert bytes(host_bytes(t)) == raw
        assert fingerprint(t) == zlib.crc32(raw)
    assert _resizable(base), "reading the tensor made its storage fixed"


@pytest.mark.skipif(PageWatch.open() is None, reason="no asynchronous write-protect on this machine")
def test_the_edges_of_watched_pages_are_read_in_place():
    watch = PageWatch.open()
    watch.min_bytes, watch.min_save_bytes = 0, 0
    t = torch.arange(600_000, dtype=torch.float32)[5:]  # neither end on a page boundary
    watch.start()
    mark = watch.claim(t)
    assert mark is not None
    mark.edges(t)
    watch.protect_claimed()
    watch.release()
    watch.unregister()
    assert _resizable(t)
