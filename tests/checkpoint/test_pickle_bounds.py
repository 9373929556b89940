"""``pickle_bounds.check_expansion``: the pre-scan that refuses a pickle whose shared objects would
make its reader build or walk far more than its size, before the reader runs.

Pickles made by the standard library's own pickler, at every protocol (each writes the memo its
own way: text ``PUT``/``GET`` at 0, ``BINPUT``/``BINGET`` at 1-3, ``MEMOIZE`` at 4-5), must pass
whatever they hold; the same objects made to share themselves level after level must be refused
at every protocol, once their expanded size passes the budget and not before.
"""

import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from modelparallel.checkpoint.safety.pickle_bounds import budget, check_expansion

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
    shared = ("a", 1)
    values = [_metadata(), {"shared": [shared] * 50, "set": {1, 2}, "frozen": frozenset({3}), "big": 10 ** 40,
                            "neg": -(2 ** 70), "f": 1.5, "nested": [[[[]]]], "t": (True, False, None)},
              list(range(1000)), "x" * 300, b"y" * 300]
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
