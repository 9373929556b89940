"""Forged checkpoints an adversarial review tried on the v2 load (``state_dict_loader.load``)
that ``test_v2_checkpoint_safety`` does not: a ``.metadata`` whose chunks leave part of a
tensor uncovered (the load would put uninitialized memory into the model), storage ranges past
a file's end or absurdly long, metadata of the wrong shape, pickles that cost exponential work
through their memo (every rank would hang), ``bytes(n)`` in the metadata, a symlinked
``.metadata``, a hard link, a data file swapped in from another checkpoint. Each must be
refused on both ranks, naming the file, before the state dict changes. Also: a save refuses a
non-tensor entry its load would refuse, before writing; plain values round-trip; a reader
subclass that reads differently is refused rather than ignored; an ``async_save`` failing over
a checkpoint leaves it loading.

The attacker recomputes the manifest's checksums (``_reseal``): whoever can write the
directory can also write a consistent manifest, so the CRC32s catch damage and mixed-up files,
never a forgery; what a forgery meets is the reader's own checks. A failure points at
``checkpoint.safety.metadata_check`` (chunks, field types), ``pickle_bounds`` (memo expansion),
``safe_load`` (the allow-list), ``load.fastread`` (storage ranges) or ``saving._prepare``.
"""

from __future__ import annotations

import collections
import enum
import io
import os
import pickle
import re
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import harness
from modelparallel.checkpoint.safety.errors import CheckpointError
from modelparallel.checkpoint.safety.files import UnsafeCheckpointError
from modelparallel.checkpoint.safety.safe_load import parse_dcp_metadata
from modelparallel.distributed.checkpoint.state_dict_loader import load
from modelparallel.distributed.checkpoint.state_dict_saver import save
from test_v2_checkpoint_safety import _metadata, _refused, _reseal, _same, _state, _storage_of, _zeros

KEY = "model.r0.w3"  # one of rank 0's tensors, shape (8, 8)


def _bomb(depth: int) -> bytes:
    """A pickled dict whose key is ``t_depth``, ``t_(k+1) = (t_k, t_k)`` through the memo: a few
    bytes per level, ``2**depth`` nodes to hash (protocol 2 opcodes, no POP: torch's own
    ``weights_only`` reader takes it too)."""
    body = b"\x80\x02}q\x00K\x00q\x01"
    for i in range(1, depth + 1):
        body += b"h%ch%c\x86q%c" % (i, i, i + 1)
    return body + b"h\x00h%cK\x01s." % (depth + 1)


def _forge(p: Path, change) -> None:
    metadata = _metadata(p)
    change(metadata)
    _reseal(p, ".metadata", pickle.dumps(metadata))


def _chunks(*boxes):
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]


def _set_chunks(p: Path, chunks) -> None:
    _forge(p, lambda m: setattr(m.state_dict_metadata[KEY], "chunks", chunks))


def _storage(p: Path, **fields) -> None:
    _forge(p, lambda m: m.storage_data[_storage_of(m, KEY)].__dict__.update(fields))


def _entry_bomb(p: Path) -> None:
    """The ``step`` entry rewritten as a ``torch.save`` file whose pickle is ``_bomb(60)``."""
    metadata = _metadata(p)
    info = metadata.storage_data[_storage_of(metadata, "step")]
    chunk = (p / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    src, out = zipfile.ZipFile(io.BytesIO(chunk)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for zi in src.infolist():
            z.writestr(zi, _bomb(60) if zi.filename.endswith("data.pkl") else src.read(zi))
    _reseal(p, "__5_0.distcp", out.getvalue())
    info.relative_path, info.offset, info.length = "__5_0.distcp", 0, len(out.getvalue())
    _reseal(p, ".metadata", pickle.dumps(metadata))


def _symlinked_metadata(p: Path) -> None:
    os.replace(p / ".metadata", p.parent / "moved")
    os.symlink(p.parent / "moved", p / ".metadata")


ATTACKS = {  # name -> (rank 0's change to the committed checkpoint, what the first line must say)
    "no chunks": (lambda p: _set_chunks(p, []), r"\.metadata: .*'model\.r0\.w3': its chunks hold 0 elements"),
    "chunk outside": (lambda p: _set_chunks(p, _chunks(((100, 0), (8, 8)))), r"\.metadata: .*passes its size"),
    "chunks overlap": (lambda p: _set_chunks(p, _chunks(((0, 0), (4, 8)), ((2, 0), (4, 8)))),
                       r"\.metadata: .*its chunks overlap"),
    "huge length": (lambda p: _storage(p, length=2**45), r"__0_0\.distcp: entry 'model\.r0\.w3' .* passes its end"),
    "negative offset": (lambda p: _storage(p, offset=-8), r"\.metadata: .*its storage is not a file name"),
    "no storage record": (lambda p: _forge(p, lambda m: m.storage_data.pop(_storage_of(m, KEY))),
                          r"\.metadata: entry 'model\.r0\.w3' has a chunk .* but no storage record"),
    "not metadata": (lambda p: _reseal(p, ".metadata", pickle.dumps({"state_dict_metadata": {}})),
                     r"\.metadata: not a valid DCP metadata file: it holds dict"),
    "storage_meta": (lambda p: _forge(p, lambda m: setattr(m, "storage_meta", {"load_id": 1})),
                     r"\.metadata: .*its storage_meta is a dict"),
    "metadata memo bomb": (lambda p: _reseal(p, ".metadata", _bomb(60)), r"\.metadata: .*refused: it builds more"),
    "entry memo bomb": (_entry_bomb, r"__5_0\.distcp: .*'step'.*refused: it builds more than"),
    "metadata symlink": (_symlinked_metadata, r"\.metadata: a symlink"),
    "hard link": (lambda p: os.link(p / "__0_0.distcp", p.parent / "linked"), r"__0_0\.distcp: a file with 2 hard"),
    "swapped": (lambda p: os.replace(p.parent / "other" / "__0_0.distcp", p / "__0_0.distcp"),
                r"__0_0\.distcp: CRC32 [0-9a-f]{8}, manifest says"),
}


def refused(root: str, name: str) -> str:
    save(_state(3.0), checkpoint_id=os.path.join(root, "other"))  # what "swapped" takes a file from
    return _refused(Path(root) / "ck", ATTACKS[name][0]).splitlines()[0]


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_forged_checkpoint_is_refused_on_both_ranks(tmp_path, name):
    firsts = harness.run(2, refused, str(tmp_path), name)
    assert firsts[0] == firsts[1], f"the ranks raised different errors: {firsts}"
    assert re.search(ATTACKS[name][1], firsts[0]), firsts[0]


class _Color(enum.Enum):
    RED = 1


PLAIN = {"lr": 0.5, "betas": (0.9, 0.99), "names": ["a", "b"], "seen": {1, 2}, "nested": {"k": [None, (1, "x")]},
         "od": collections.OrderedDict(x=1), "dtype": torch.float16, "raw": b"\x00\xff", "z": 1 + 2j}


def plain_values(root: str) -> tuple:
    """Plain values round-trip; a value the load's allow-list would refuse fails the save on
    every rank before anything is written."""
    import numpy as np

    state = {"w": torch.arange(4.0), "extra": PLAIN}  # one key saved once: the same on both ranks
    save(state, checkpoint_id=os.path.join(root, "ok"))
    blank = lambda v: type(v)((k, blank(x)) for k, x in v.items()) if isinstance(v, dict) else None  # noqa: E731
    back = {"w": torch.zeros(4), "extra": blank(PLAIN)}
    load(back, checkpoint_id=os.path.join(root, "ok"))
    refusals = []
    for bad in (np.float32(1.5), _Color.RED, np.arange(2), b""):  # b"": pickled as bytes(), which torch refuses
        with pytest.raises(CheckpointError) as info:
            save({"w": state["w"], "extra": {"lr": bad}}, checkpoint_id=os.path.join(root, "bad"))
        refusals.append(str(info.value).splitlines()[0])
    dist.barrier()
    assert not os.path.exists(os.path.join(root, "bad")) and sorted(os.listdir(root)) == ["ok"], os.listdir(root)
    return torch.equal(back["w"], state["w"]) and back["extra"] == PLAIN, refusals


def test_plain_values_round_trip_and_what_a_load_refuses_is_not_saved(tmp_path):
    for ok, refusals in harness.run(2, plain_values, str(tmp_path)):
        assert ok, "plain values came back different"
        for first, kind in zip(refusals, ("an object of type numpy.float32", "an object of type \\S*_Color",
                                          "an object of type numpy.ndarray", "an unsupported value")):
            assert re.match(rf"TypeError: state dict entry 'extra\.lr' holds {kind}", first), first


def forged_layout(root: str) -> str:
    """A local state dict's layout record (``.sm_local_layout.json``) forged as JSON nested past
    the parser's depth: refused on both ranks naming the file, nothing changed."""
    from modelparallel.distributed.checkpoint.state_dict_utils import LOCAL_LAYOUT_FILE, LocalStateDict

    def local(value: float) -> dict:
        model = LocalStateDict({"w": torch.full((3,), value)})
        model.layout, model.replicas = {"fsdp_shard_degree": 1, "tensor_parallel_degree": 1}, (0, 1)
        return {"model": model}

    path = Path(root) / "ck"
    save(local(2.0), checkpoint_id=str(path))
    if dist.get_rank() == 0:
        _reseal(path, LOCAL_LAYOUT_FILE, b"[" * 100_000 + b"]" * 100_000)
    dist.barrier()
    target = local(0.0)
    with pytest.raises(CheckpointError) as info:
        load(target, checkpoint_id=str(path))
    assert torch.equal(target["model"]["w"], torch.zeros(3)), "a refused load changed the state dict"
    return str(info.value).splitlines()[0]


def test_a_layout_record_nested_too_deeply_is_refused_naming_it(tmp_path):
    firsts = harness.run(2, forged_layout, str(tmp_path))
    assert firsts[0] == firsts[1] and re.search(r"ck/\.sm_local_layout\.json: unreadable", firsts[0]), firsts


class _OwnReader(FileSystemReader):
    def read_data(self, plan, planner):  # e.g. decrypting: the load would not call it
        raise AssertionError("never called")


class _OwnPlanner(DefaultLoadPlanner):
    pass


class _FailsOnRank1(FileSystemWriter):
    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


def readers_and_failed_async(root: str) -> bool:
    """A reader subclass that reads differently, or a planner subclass, is refused;
    ``FileSystemReader`` reads through the verified path. An ``async_save`` that fails on one
    rank over a checkpoint leaves that checkpoint loading as it was."""
    from modelparallel.distributed.checkpoint.async_utils import AsyncCallsQueue
    from modelparallel.distributed.checkpoint.state_dict_saver import async_save

    path = os.path.join(root, "ck")
    save(_state(2.0), checkpoint_id=path)
    target = _zeros()
    with pytest.raises(NotImplementedError, match=r"storage_reader=_OwnReader: .*overrides read_metadata, read_data"):
        load(target, storage_reader=_OwnReader(path))
    with pytest.raises(NotImplementedError, match=r"planner=_OwnPlanner: only DCP's DefaultLoadPlanner"):
        load(target, checkpoint_id=path, planner=_OwnPlanner())  # its load_bytes could unpickle freely
    assert _same(target, _zeros())
    queue = AsyncCallsQueue()
    async_save(_state(3.0), storage_writer=_FailsOnRank1(path), queue=queue)
    with pytest.raises(CheckpointError, match="No space left on device"):
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    load(target, storage_reader=FileSystemReader(path))
    dist.barrier()
    return _same(target, _state(2.0)) and sorted(os.listdir(root)) == ["ck"]


def test_reader_subclasses_and_a_failed_async_save(tmp_path):
    assert harness.run(2, readers_and_failed_async, str(tmp_path)) == [True, True]


def test_metadata_pickled_with_an_empty_bytes_at_protocol_2_loads():
    """Protocol 2 pickles ``b""`` as ``bytes()``: still accepted (only ``bytes(n)`` is refused)."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = Metadata(state_dict_metadata={}, planner_data={"empty": b""}, storage_data={})
    assert b"bytes" in pickle.dumps(metadata, protocol=2)
    assert parse_dcp_metadata(pickle.dumps(metadata, protocol=2), "x/.metadata") == metadata


@pytest.mark.parametrize("data,refused", [
    (b"\x80\x04cbuiltins\nbytes\nJ\x00\x00\x00\x08\x85R.", r"refused bytes\(\.\.\.\) with arguments"),
    (b"\x80\x04cbuiltins\nbytes\nJ\x00\x00\x00\x08\x85\x81.", "NEWOBJ class argument must be a type"),
    (b"\x80\x04\x8e" + (2**40).to_bytes(8, "little") + b"xx.", r"asks for 1099511627776 bytes, 3 remain"),
], ids=["bytes(n)", "bytes.__new__(bytes, n)", "bytes8 length past the end"])
def test_metadata_naming_a_huge_allocation_is_refused_before_it(data, refused):
    """Each would make every rank allocate (and for ``bytes(n)`` zero) 128 MiB to 1 TiB from a
    few bytes of ``.metadata``; refused by the allow-list or the pre-scan, naming the file."""
    with pytest.raises(UnsafeCheckpointError, match=r"^x/\.metadata: not a valid DCP metadata file: .*" + refused):
        parse_dcp_metadata(data, "x/.metadata")
