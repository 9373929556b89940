"""The verified DCP reader (``checkpoint.fastread``), in one process: what it reads must equal
what was saved for every dtype and layout, whether a chunk takes the direct path (read straight
into the destination) or is read whole and loaded; a chunk whose bytes differ from the manifest
is refused naming the file."""

from __future__ import annotations

import dataclasses
import json
import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from modelparallel.checkpoint.safety import commit
from modelparallel.checkpoint.load import fastread
from modelparallel.checkpoint.save.planner import ContiguousSavePlanner
from modelparallel.checkpoint.safety.files import CheckpointFiles


def saved_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(33, 17, generator=g),
        "transposed": torch.randn(8, 12, generator=g).t(),  # non-contiguous: stored contiguous
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "int64": torch.randint(-2**40, 2**40, (9,), generator=g),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "slice": torch.randn(20, 6, generator=g)[5:15],  # a view into a larger storage
        "blob": io.BytesIO(b"not a tensor"),
        "step": 7,
    }


def fresh_like(state: dict, dtype_of: dict | None = None) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=(dtype_of or {}).get(k, v.dtype))
        elif isinstance(v, io.BytesIO):
            out[k] = io.BytesIO()
        else:
            out[k] = 0
    return out


def save(state: dict, path, contiguous: bool) -> None:
    """``state`` as DCP part ``path/part``, with a manifest of its files in ``path``."""
    planner = ContiguousSavePlanner() if contiguous else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=FileSystemWriter(path / "part"), planner=planner)
    commit.write_manifest(path, {"files": {f: commit.file_checksum(path / f) for f in commit.data_files(path)}})


def reader(path, contiguous: bool) -> fastread.FastReader:
    return fastread.FastReader(CheckpointFiles(path, json.loads((path / commit.MANIFEST).read_text())), "part", contiguous)


def load(target: dict, path, contiguous: bool, monkeypatch) -> list[str]:
    """Load and return the keys that took the direct path."""
    direct = []
    real = fastread._read_into
    monkeypatch.setattr(fastread, "_read_into", lambda r, t, h=None: (direct.append(t.shape), real(r, t, h)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader(path, contiguous))
    return direct


def assert_loaded(target: dict, state: dict) -> None:
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert target[k].dtype == v.dtype or k == "fp32", k
            assert torch.equal(target[k].to(v.dtype), v), k
        elif isinstance(v, io.BytesIO):
            assert target[k].getvalue() == v.getvalue(), k
        else:
            assert target[k] == v, k


def test_direct_read_equals_saved_for_every_dtype_and_layout(tmp_path, monkeypatch):
    state = saved_state()
    save(state, tmp_path, contiguous=True)
    target = fresh_like(state)
    direct = load(target, tmp_path, True, monkeypatch)
    assert_loaded(target, state)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel()]
    assert len(direct) == len(tensors), "every non-empty tensor was read in place"


def test_dtype_change_and_unmarked_checkpoints_go_through_dcp(tmp_path, monkeypatch):
    state = saved_state()
    save(state, tmp_path / "plain", contiguous=False)
    target = fresh_like(state)
    assert load(target, tmp_path / "plain", False, monkeypatch) == []
    assert_loaded(target, state)
    save(state, tmp_path / "marked", contiguous=True)
    target = fresh_like(state, {"fp32": torch.float64})
    direct = load(target, tmp_path / "marked", True, monkeypatch)
    assert_loaded(target, state)
    assert torch.Size([33, 17]) not in direct, "a dtype change is DCP's (it converts)"


def test_partial_destination_slices_go_through_dcp(tmp_path, monkeypatch):
    """A destination that is a part of a stored chunk (resharding) cannot be read in place."""
    full = torch.arange(48.0).reshape(8, 6)
    save({"w": full}, tmp_path, contiguous=True)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class HalfPlanner(DefaultLoadPlanner):  # asks only for rows 4..7, as a TP=2 rank 1 would
        def create_local_plan(self):
            plan = super().create_local_plan()
            (item,) = plan.items
            item = dataclasses.replace(item, storage_offsets=torch.Size([4, 0]), lengths=torch.Size([4, 6]))
            return dataclasses.replace(plan, items=[item])

        def resolve_tensor(self, read_item):
            return self.state_dict["w"][:4]

    target = {"w": torch.zeros(8, 6)}
    direct = []
    monkeypatch.setattr(fastread, "_read_into", lambda *a: direct.append(a))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader(tmp_path, True), planner=HalfPlanner())
    assert direct == [] and torch.equal(target["w"][:4], full[4:])


@pytest.mark.parametrize("damage", ["zip directory", "record size"])
def test_unexpected_chunk_layout_is_read_whole(tmp_path, damage, monkeypatch):
    """If a chunk is not the one-record zip the direct path expects, it is read whole and
    loaded (``torch.load``), still verified."""
    real = fastread._data_layout

    def spy(tail, length, nbytes):
        return real(tail, length, nbytes + 1)

    state = {"w": torch.arange(12.0).reshape(3, 4)}
    save(state, tmp_path, contiguous=True)
    monkeypatch.setattr(fastread, "_data_layout", spy if damage == "record size" else lambda *a: None)
    target = {"w": torch.zeros(3, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader(tmp_path, True))
    assert torch.equal(target["w"], state["w"])


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_flipped_byte_is_refused_naming_the_file(tmp_path, contiguous):
    """The reader hashes every byte it reads; a file that no longer matches the manifest fails
    at the end of the file, on both the direct and the whole-chunk path."""
    state = {"w": torch.arange(4096.0)}
    save(state, tmp_path, contiguous=True)
    victim = tmp_path / "part" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(BaseException, match=r"part/__0_0.distcp: CRC32 \w{8}, manifest says \w{8} \(corrupted\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"w": torch.zeros(4096)}, storage_reader=reader(tmp_path, contiguous))


def test_files_read_in_pieces_on_threads_load_and_verify_as_one_pass(tmp_path, monkeypatch):
    """A file larger than ``crc.PIECE`` is read and checksummed on several threads: what loads
    equals what was saved, and a flipped byte in any piece is still refused."""
    from modelparallel.checkpoint.safety import crc

    monkeypatch.setattr(crc, "PIECE", 4096)
    monkeypatch.setattr(crc, "_SHIFT_PIECE", crc._shift(4096))
    state = saved_state() | {"big": torch.randn(40, 1000, generator=torch.Generator().manual_seed(2))}
    save(state, tmp_path, contiguous=True)
    target = fresh_like(state)
    assert torch.Size([40, 1000]) in load(target, tmp_path, True, monkeypatch)
    assert_loaded(target, state)
    victim = tmp_path / "part" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 4
    victim.write_bytes(bytes(data))
    with pytest.raises(BaseException, match=r"__0_0.distcp: CRC32 \w{8}, manifest says \w{8} \(corrupted\)"):
        load(fresh_like(state), tmp_path, True, monkeypatch)
