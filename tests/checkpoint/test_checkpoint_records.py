"""Tensors written as ``torch.save`` writes them (modelparallel/checkpoint/save/records.py), and the
save's writer that uses it (writer.CheckpointWriter).

A failure means a checkpoint file differs from what ``torch.save`` / DCP's own writer produce
for the same state: a file DCP's reader, ``torch.load`` or our fast reader could misread (a
wrong shape, stride or dtype reused from another tensor's record, a tensor's bytes misplaced),
or an error in a writer thread that the save does not raise.
"""

import io
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from modelparallel.checkpoint.save import records, writer
from modelparallel.checkpoint.save.planner import ContiguousSavePlanner


@pytest.fixture(params=[False, True], ids=["zip-crc-off", "zip-crc-on"])
def crc(request):
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(request.param)
    yield request.param
    torch.serialization.set_crc32_options(before)


def saved(tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def written(tensor, recs=None) -> bytes:
    out = io.BytesIO()
    (recs or records.TensorRecords()).write(tensor, out)
    return out.getvalue()


def plain_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"f32": torch.randn(300, 70, generator=g), "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "f16": torch.randn(7, generator=g).half(), "i64": torch.arange(11),
            "bool": torch.rand(9, generator=g) > 0.5,
            "c64": torch.randn(4, dtype=torch.complex64, generator=g), "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4), "size1_stride": torch.randn(1, 6, generator=g).as_strided((1, 6), (99, 1)),
            "u8": torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g)}


def test_plain_tensors_are_written_byte_for_byte_as_torch_save(crc):
    recs = records.TensorRecords()
    for name, t in plain_tensors().items():
        assert written(t, recs) == saved(t), name
        other = torch.zeros_like(t) if t.dtype != torch.bool else ~t  # same signature, other bytes
        assert written(other, recs) == saved(other), f"{name}: a signature's records reused"
        if not crc:
            assert records.signature(t) is not None, f"{name} takes the fast path"


def test_shapes_and_strides_are_not_confused():
    """Tensors of the same size but another shape, stride or dtype get their own records."""
    torch.serialization.set_crc32_options(False)
    try:
        recs = records.TensorRecords()
        base = torch.arange(24, dtype=torch.float32)
        for t in [base, base.view(4, 6), base.view(6, 4), base.view(2, 3, 4), base.view(torch.int32),
                  torch.randn(1, 24).as_strided((1, 24), (24, 1)), torch.randn(1, 24).as_strided((1, 24), (1, 1))]:
            data = written(t, recs)
            assert data == saved(t), (t.shape, t.stride(), t.dtype)
            loaded = torch.load(io.BytesIO(data), weights_only=True)
            assert torch.equal(loaded, t) and loaded.stride() == t.stride() and loaded.dtype == t.dtype
    finally:
        torch.serialization.set_crc32_options(True)


def test_anything_else_goes_through_torch_save():
    torch.serialization.set_crc32_options(False)
    try:
        big = torch.randn(10, 10)
        others = {"view": big[2:4], "offset_view": big.view(-1)[5:], "noncontig": big.t(),
                  "grad": torch.randn(3).requires_grad_(),
                  "param": torch.nn.Parameter(torch.randn(3)), "conj": torch.randn(3, dtype=torch.complex64).conj(),
                  "neg": torch.randn(3, dtype=torch.complex64).conj().imag,
                  "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
                  "sparse": torch.randn(4, 4).to_sparse()}
        for name, t in others.items():
            assert records.signature(t) is None, name
            assert written(t) == saved(t), name
    finally:
        torch.serialization.set_crc32_options(True)


def state() -> dict:
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(37 + i, 11, generator=g) for i in range(9)}
    state.update(view=torch.randn(50, 8, generator=g)[10:20], t=torch.randn(8, 6, generator=g).t(),
                 b=torch.randn(5, generator=g).to(torch.bfloat16), step=7, name="x")
    return state


def data_files(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix == ".distcp"}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_writer_writes_the_files_dcps_writer_writes(tmp_path, crc, threads):
    """Every tensor item's bytes are what ``torch.save`` writes for it under the caller's zip
    CRC setting, in every writer thread; the files are DCP's own writer's, byte for byte, where
    all of its threads use that setting too (one thread, or the CRC on: its extra threads start
    with PyTorch's defaults); DCP's reader loads them."""
    ours, theirs = tmp_path / "ours", tmp_path / "dcp"
    dcp.save(state(), storage_writer=writer.CheckpointWriter(ours, threads=threads), planner=ContiguousSavePlanner(),
             no_dist=True)
    dcp.save(state(), storage_writer=FileSystemWriter(theirs, thread_count=threads, sync_files=False),
             planner=ContiguousSavePlanner(), no_dist=True)
    mine, want = data_files(ours), data_files(theirs)
    assert len(mine) == threads and mine.keys() == want.keys()
    if crc or threads == 1:
        for name in mine:
            assert mine[name] == want[name], name
    items = FileSystemReader(ours).read_metadata().storage_data
    tensors = {k: v for k, v in state().items() if isinstance(v, torch.Tensor)}
    assert {index.fqn for index in items} >= tensors.keys()
    for index, info in items.items():
        if index.fqn in tensors:
            got = mine[info.relative_path][info.offset:info.offset + info.length]
            assert got == saved(tensors[index.fqn].contiguous().clone()), index.fqn
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state().items()}
    dcp.load(target, storage_reader=FileSystemReader(ours), no_dist=True)
    for k, v in state().items():
        assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v, k


def test_checksums_cover_every_thread_file(tmp_path):
    sums = writer.save(state(), tmp_path, ContiguousSavePlanner())
    for p in tmp_path.iterdir():
        data = p.read_bytes()
        assert sums[str(p)] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, p.name
    assert sum(p.suffix == ".distcp" for p in tmp_path.iterdir()) == writer.THREADS


@pytest.mark.parametrize("failing", ["w0", "w8", "b"])
def test_an_error_in_any_writer_thread_is_raised(tmp_path, failing):
    class Failing(ContiguousSavePlanner):
        def resolve_data(self, write_item):
            if write_item.index.fqn == failing:
                raise RuntimeError(f"cannot read {failing}")
            return super().resolve_data(write_item)

    with pytest.raises(CheckpointException) as raised:
        writer.save(state(), tmp_path, Failing())
    assert f"cannot read {failing}" in str(raised.value.failures), "DCP reports the thread's error"


def test_dcp_runs_the_writers_own_file_writing(tmp_path, monkeypatch):
    """``CheckpointWriter`` replaces ``FileSystemWriter._write_data`` (a PyTorch internal): if a
    PyTorch release stopped calling it, saves would silently go back to a ``torch.save`` per
    tensor. Every tensor must pass through ``TensorRecords``."""
    seen = []
    real = records.TensorRecords.write
    monkeypatch.setattr(records.TensorRecords, "write", lambda self, t, s: (seen.append(t.shape), real(self, t, s)))
    writer.save(state(), tmp_path, ContiguousSavePlanner())
    assert len(seen) == sum(isinstance(v, torch.Tensor) for v in state().values())
