"""``pickle_bounds.check_expansion``: the pre-scan that refuses a pickle whose shared objects would
make its reader build or walk far more than its size, before the reader runs.

Pickles made by the standard library's own pickler, at every protocol (each writes the memo its
own way: text ``PUT``/``GET`` at 0, ``BINPUT``/``BINGET`` at 1-3, ``MEMOIZE`` at 4-5), must pass
whatever they hold; the same objects made to share themselves level after level must be refused
at every protocol, once their expanded size passes the budget and not before. Keys chosen to
share one hash (``pickle_keys``) are in ``test_pickle_keys.py``.
"""

import io
import pickle
import struct
import zipfile

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from modelparallel.checkpoint.safety.pickle_bounds import budget, check_expansion
from modelparallel.checkpoint.safety.safe_load import (MetadataUnpickler, UnsafeCheckpointError, parse_dcp_metadata,
                                                      torch_load)

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


def _metadata(tensors: int = 8, chunks: int = 4) -> Metadata:
    """DCP metadata as a save writes it: shared dtypes and sizes, one chunk record per shard."""
    state, storage = {}, {}
    for t in range(tensors):
        fqn = f"layers.{t}.weight"
        parts = [ChunkStorageMetadata(offsets=torch.Size([c * 4, 0]), sizes=torch.Size([4, 8])) for c in range(chunks)]
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4 * chunks, 8]), parts)
        for c in range(chunks):
            storage[MetadataIndex(fqn, torch.Size([c * 4, 0]))] = (f"__{c}_0.distcp", t * 64, 64)
    return Metadata(state_dict_metadata=state, storage_data=storage, planner_data={"x": [1, 2.5, "s", b"\x00", None]})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_what_the_standard_pickler_writes_passes(protocol):
    shared, long_text, long_bytes = ("a", 1), "x" * 5000, b"z" * 5000
    values = [_metadata(), {"shared": [shared] * 50, "set": {1, 2}, "frozen": frozenset({3}), "big": 10 ** 40,
                            "neg": -(2 ** 70), "f": 1.5, "nested": [[[[]]]], "t": (True, False, None)},
              list(range(1000)), "x" * 300, b"y" * 300, [long_text] * 3000, [long_bytes] * 3000,
              [bytearray(), bytearray(b"ab" * 3000)], {long_text: [long_text, (long_text, 1)]}]
    for value in values:
        data = pickle.dumps(value, protocol=protocol)
        check_expansion(data)
        assert pickle.loads(data) == value  # the data is what the standard library reads back


def _doubling(depth: int, protocol: int) -> bytes:
    """``t_(k+1) = [t_k, t_k]`` ``depth`` times, pickled by the standard pickler: a few bytes a
    level, ``2**depth`` leaves when walked."""
    t: list = ["leaf"]
    for _ in range(depth):
        t = [t, t]
    return pickle.dumps(t, protocol=protocol)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_objects_shared_level_after_level_are_refused_past_the_budget(protocol):
    """The expanded size of ``_doubling(d)`` is about ``2**(d+1)`` nodes; its bytes grow by a
    few per level, so the budget (linear in bytes) is passed near d = log2(budget): below
    stays accepted, well above is refused."""
    check_expansion(_doubling(12, protocol))  # ~8k nodes from ~100 bytes: within 1 Mi
    for depth in (22, 40, 200):  # ~8 Mi nodes and more
        data = _doubling(depth, protocol)
        assert 2 ** depth > budget(len(data))
        with pytest.raises(pickle.UnpicklingError, match="refused: it builds more than"):
            check_expansion(data)


def _grows_after_shared(n: int) -> bytes:
    """``a = []``, ``b = [a] * n``, then ``a`` filled with ``n`` items through its memo entry:
    ``2n`` opcodes, ``n * n`` nodes to walk ``b``. Python's pickler never writes this (it fills
    an object before handing it out again), so it is written here opcode by opcode."""
    return (b"\x80\x02]q\x00]q\x01(" + b"h\x00" * n + b"eh\x00(" + b"K\x01" * n + b"e0h\x01.")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_container_of_itself_is_refused(protocol):
    """No checkpoint of tensors and plain data holds a cycle; a reader walking one never ends."""
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(pickle.UnpicklingError, match="adds to an object its memo already handed out"):
        check_expansion(pickle.dumps(loop, protocol=protocol))


def test_an_object_filled_after_it_was_shared_is_refused():
    data = _grows_after_shared(100_000)
    assert len(pickle.loads(data)[0]) == 100_000  # what the reader would build: 10**10 nodes to walk
    with pytest.raises(pickle.UnpicklingError, match="grows after it was shared"):
        check_expansion(data)


@pytest.mark.parametrize("data", [b"", b"\x80\x02", b"\x80\x02]q\x00", b"\xff.", b"\x80\x02h\x05.",
                                  b"\x80\x04\x8e" + (2 ** 40).to_bytes(8, "little") + b"xx.", b"(t"],
                         ids=["empty", "no STOP", "cut after a PUT", "no such opcode", "GET of nothing",
                              "a length past the end", "cut after TUPLE"])
def test_damaged_pickles_are_refused_naming_nothing_else(data):
    with pytest.raises(pickle.UnpicklingError, match="not a valid pickle"):
        check_expansion(data)


def _calls(callable_global: bytes, argument: bytes, times: int, keep: bool = True) -> bytes:
    """``[f(a), f(a), ...]`` (or each result dropped: ``keep=False``): ``f`` (a ``GLOBAL`` line
    pair) called ``times`` on the one object ``argument`` pushes (memo 1), by protocol 2 opcodes."""
    calls = b"h\x00h\x01\x85R" * times
    kept = b"](" + calls + b"e." if keep else b"(" + calls + b"1N."  # POP_MARK: all dropped at once
    return b"\x80\x02c" + callable_global + b"q\x00" + argument + b"q\x010" + kept


def _text(n: int) -> bytes:
    return b"X" + struct.pack("<I", n) + b"a" * n


@pytest.mark.parametrize("callable_global, argument", [
    (b"__builtin__\nlist\n", _text(100_000)),  # a pointer per character, each call
    (b"pathlib\nPosixPath\n", _text(100_000)),  # a new string (its parts) per call
    (b"__builtin__\nstr\n", b"](" + _text(100_000) + b"q\x02" + b"h\x02" * 30 + b"e"),  # str of a list: 30 copies
], ids=["list(s)", "PosixPath(s)", "str([s] * 30)"])
def test_a_call_pays_for_every_character_it_is_given(callable_global, argument):
    """A string shared through the memo costs one node where it is stored, but an allowed
    callable given it (``MetadataUnpickler`` allows these) makes something as long, per call."""
    check_expansion(_calls(callable_global, argument, 1))
    for keep in (True, False):  # what the reader would make: far past the budget, kept or not
        many = _calls(callable_global, argument, 2000, keep)
        assert len(many) * 64 < 2000 * 100_000
        with pytest.raises(pickle.UnpicklingError, match="builds more than"):
            check_expansion(many)
    built = MetadataUnpickler(io.BytesIO(_calls(callable_global, argument, 3))).load()
    assert len(built) == 3 and len(str(built[0])) >= 100_000  # the reader does build each one


def test_a_long_number_hashed_many_times_is_refused():
    """Hashing a number walks all its digits (no hash is kept): one stored once, added to a set
    20000 times through the memo, walks 20000 times its bytes."""
    number = pickle.dumps(1 << 80_000, 2)[2:-1]
    data = b"\x80\x04" + number + b"\x940\x8f(" + b"h\x00" * 20_000 + b"\x90."
    assert pickle.loads(data) == {1 << 80_000}
    with pytest.raises(pickle.UnpicklingError, match="builds more than"):
        check_expansion(data)


@pytest.mark.parametrize("data", [b"\x80\x02Nr" + struct.pack("<I", 1 << 26) + b".", b"Np67108864\n."],
                         ids=["LONG_BINPUT", "PUT"])
def test_a_memo_index_past_the_data_is_refused(data):
    """Python's C unpickler sizes its memo array by the largest index: 9 bytes would make it
    allocate and zero 1 GiB (4 bytes of index: up to 64 GiB). The pickler numbers from 0."""
    with pytest.raises(pickle.UnpicklingError, match="memo index of 67108864"):
        check_expansion(data)


def _zip_with(pickled: bytes) -> bytes:
    """A ``torch.save`` file whose ``data.pkl`` is ``pickled``."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    source, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for info in source.infolist():
            w.writestr(info, pickled if info.filename.endswith("data.pkl") else source.read(info))
    return out.getvalue()


def test_torch_load_refuses_bytearray_of_a_number_and_reads_bytearray_of_bytes():
    """``torch.load(weights_only=True)`` allows ``bytearray``: ``bytearray(n)`` allocates ``n``
    bytes (4 calls of 2**28 here: 1 GiB from 67 bytes); the pickler only ever writes it on text."""
    attack = b"\x80\x02c__builtin__\nbytearray\nq\x00](" + (b"h\x00J" + struct.pack("<i", 1 << 28) + b"\x85R") * 4 + b"e."
    with pytest.raises(UnsafeCheckpointError, match=r"bytearray\(\) on no string"):
        torch_load(io.BytesIO(_zip_with(attack)), "x.pt")
    buf = io.BytesIO()
    torch.save({"b": bytearray(b"ab" * 100), "e": bytearray()}, buf)
    assert torch_load(io.BytesIO(buf.getvalue()), "y.pt") == {"b": bytearray(b"ab" * 100), "e": bytearray()}


def test_torch_load_checks_a_path_and_the_format_before_zips(tmp_path):
    """A file read by its path (single-file resume memory-maps one) and a file in ``torch.save``'s
    format before zips (pickles one after another) are checked like a zip read from memory."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION
    (tmp_path / "z.pt").write_bytes(_zip_with(_doubling(40, 2)))
    with pytest.raises(UnsafeCheckpointError, match="builds more than"):
        torch_load(str(tmp_path / "z.pt"), mmap=True)
    info = {"protocol_version": PROTOCOL_VERSION, "little_endian": True, "type_sizes": {"short": 2, "int": 4}}
    head = b"".join(pickle.dumps(v, 2) for v in (MAGIC_NUMBER, PROTOCOL_VERSION, info))
    with pytest.raises(UnsafeCheckpointError, match="builds more than"):
        torch_load(io.BytesIO(head + _doubling(40, 2) + pickle.dumps([], 2)), "old.pt")
    buf = io.BytesIO()
    torch.save({"w": torch.arange(2.0)}, buf)  # a zip after them: Python's zipfile reads that zip, torch those pickles
    with pytest.raises(UnsafeCheckpointError, match="data before its zip"):
        torch_load(io.BytesIO(head + _doubling(40, 2) + pickle.dumps([], 2) + buf.getvalue()), "both.pt")
    state = {"w": torch.arange(6.0), "view": [torch.arange(6.0)[2:4]], "names": {"a", "b"}}
    buf = io.BytesIO()
    torch.save(state, buf, _use_new_zipfile_serialization=False)
    (tmp_path / "old.pt").write_bytes(buf.getvalue())
    for source in (io.BytesIO(buf.getvalue()), str(tmp_path / "old.pt")):
        back = torch_load(source, "old.pt")
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["view"][0], state["view"][0])


def test_a_dcp_checkpoint_saved_by_torch_loads_through_the_checked_readers(tmp_path):
    """``dcp.save`` in one process, then read back with its ``.metadata`` through
    ``parse_dcp_metadata`` and its non-tensor entries through ``torch_load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from modelparallel.checkpoint.load.fastread import SafeLoadPlanner

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return parse_dcp_metadata((tmp_path / ".metadata").read_bytes(), tmp_path / ".metadata")

    state = {f"layers.{i}.weight": torch.randn(4, 3) for i in range(50)}
    state["extra"] = ({i * 3: str(i) for i in range(1000)}, {"a", "b"}, 7)  # a tuple: stored whole, not flattened
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    back = {k: torch.zeros(4, 3) for k in state if k != "extra"} | {"extra": ()}
    dcp.load(back, storage_reader=Reader(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state if k != "extra") and back["extra"] == state["extra"]
