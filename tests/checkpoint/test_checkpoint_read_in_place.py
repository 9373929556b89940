"""Checkpoints read and write the training's tensors in place (``modelparallel.host_bytes``) and
leave them as they were: an asynchronous save's CRC-32 of a deferred tensor
(``deferred.fingerprint``) and of the edges of its watched pages (``pages.Mark.edges``) is zlib's
CRC-32 of the same bytes, and after saves (synchronous, asynchronous) and a resume, which reads
chunks straight into the model, every storage of the model and the optimizer may still be
resized (FSDP frees storages by resizing them). ``Tensor.numpy()`` would mark them not
resizable, for good."""

import zlib

import pytest
import torch
from torch.distributed.tensor import DTensor

import harness
import modelparallel as smp
from ckpt_helpers import build
from modelparallel.checkpoint.background.deferred import fingerprint
from modelparallel.checkpoint.background.pages import PageWatch
from modelparallel.host_bytes import host_bytes


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


def _fixed_storages(model, optimizer) -> list[str]:
    tensors = dict(model.module.named_parameters())
    for p, slots in optimizer.optimizer.state.items():
        tensors.update({f"slot {k} of {tuple(p.shape)}": v for k, v in slots.items() if isinstance(v, torch.Tensor)})
    return [name for name, t in tensors.items() if not _resizable(t.to_local() if isinstance(t, DTensor) else t)]


def saves_and_a_resume(root: str) -> list[str]:
    model, optimizer = build(tp=2, steps=1)
    smp.save_checkpoint(root, tag="sync", partial=True, model=model, optimizer=optimizer)
    smp.save_checkpoint(root, tag="async", partial=True, model=model, optimizer=optimizer, async_save=True)
    ids = torch.arange(8).reshape(1, 8)
    model.backward(model(ids, labels=ids).loss)  # the next step waits for the deferred copies
    optimizer.step()
    smp.wait_for_checkpoints()
    smp.resume_from_checkpoint(root, tag="sync", partial=True)
    model.backward(model(ids, labels=ids).loss)  # the resume is applied at the next step
    return _fixed_storages(model, optimizer)


def test_saves_and_a_resume_leave_every_storage_resizable(tmp_path):
    for fixed in harness.run(2, saves_and_a_resume, str(tmp_path)):
        assert fixed == [], f"storages made fixed by a checkpoint: {fixed}"
