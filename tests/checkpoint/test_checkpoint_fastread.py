"""The direct DCP read path (``checkpoint.fastread``), in one process: what it reads must equal
what was saved for every dtype and layout, and whatever it cannot map one-to-one must still
arrive through DCP's own reader."""

from __future__ import annotations

import dataclasses
import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from modelparallel.checkpoint import fastread


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
    planner = fastread.ContiguousSavePlanner() if contiguous else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=FileSystemWriter(path), planner=planner)


def load(target: dict, path, contiguous: bool, monkeypatch) -> list[str]:
    """Load and return the keys that took the direct path."""
    direct = []
    real = fastread._read_into
    monkeypatch.setattr(fastread, "_read_into", lambda fd, off, t, p: (direct.append(t.shape), real(fd, off, t, p)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=fastread.FastReader(path, contiguous))
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
        dcp.load(target, storage_reader=fastread.FastReader(tmp_path, True), planner=HalfPlanner())
    assert direct == [] and torch.equal(target["w"][:4], full[4:])


@pytest.mark.parametrize("damage", ["zip directory", "record size"])
def test_unexpected_chunk_layout_falls_back(tmp_path, damage, monkeypatch):
    """If a chunk is not the one-record zip the direct path expects, DCP decides (here: it fails
    loudly on a broken zip, or reads the data that is there)."""
    fd_len = {}
    real = fastread._data_range

    def spy(fd, start, length, nbytes):
        fd_len["n"] = nbytes
        return real(fd, start, length, nbytes + (1 if damage == "record size" else 0))

    state = {"w": torch.arange(12.0).reshape(3, 4)}
    save(state, tmp_path, contiguous=True)
    monkeypatch.setattr(fastread, "_data_range", spy if damage == "record size" else lambda *a: None)
    target = {"w": torch.zeros(3, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=fastread.FastReader(tmp_path, True))
    assert torch.equal(target["w"], state["w"])
