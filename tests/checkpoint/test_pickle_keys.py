"""``pickle_keys``, through ``check_expansion`` and the checked readers: a dict, set or frozenset
of keys chosen to share one hash (numbers ``k * (2**61 - 1)``, tuples of them, DCP's
``MetadataIndex`` offsets, numbers made from text) is refused before the reader builds it and
compares each new key with all before it; what real data holds (many distinct keys, the few
collisions it has) passes.

A failure points at modelparallel/checkpoint/safety/pickle_keys.py (which values the scan knows,
what it counts) or its use in pickle_bounds.py. Kept apart from ``test_pickle_bounds.py`` (the
expansion budget), whose DCP metadata and zip helpers these reuse.
"""

import io
import pickle
import struct
from pathlib import PosixPath

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from modelparallel.checkpoint.safety import pickle_keys
from modelparallel.checkpoint.safety.pickle_bounds import check_expansion
from modelparallel.checkpoint.safety.safe_load import (MetadataUnpickler, UnsafeCheckpointError, parse_dcp_metadata,
                                                      torch_load)
from test_pickle_bounds import PROTOCOLS, _metadata, _zip_with

P = 2 ** 61 - 1
"""Every multiple of it hashes to 0 on 64-bit CPython: keys chosen to make the reader's dict
compare each new key with all before it (20,000 of them: 2 s, and quadratic)."""


def _unicode(text: bytes) -> bytes:
    return b"X" + struct.pack("<I", len(text)) + text


def _int(n: int) -> bytes:
    return pickle.dumps(n, 2)[2:-1]


def _batched(keys: list, empty: bytes, close: bytes, value: bytes = b"") -> bytes:
    """A container filled like the pickler fills one: 1000 keys (each with ``value``) per batch."""
    batches = (b"(" + b"".join(k + value for k in keys[i:i + 1000]) + close for i in range(0, len(keys), 1000))
    return empty + b"".join(batches)


def _flood(shape: str, n: int) -> bytes:
    ints = [_int(k * P) for k in range(1, n + 1)]
    body = {"dict of ints": lambda: _batched(ints, b"}", b"u", b"N"),
            "dict of tuples": lambda: _batched([k + b"K\x01\x86" for k in ints], b"}", b"u", b"N"),
            "dict of (dtype, int)": lambda: b"ctorch\nfloat32\nq\x010" + _batched(
                [b"h\x01" + k + b"\x86" for k in ints], b"}", b"u", b"N"),  # a global stands for itself
            "set": lambda: _batched(ints, b"\x8f", b"\x90"),
            "frozenset": lambda: b"(" + b"".join(ints) + b"\x91",
            "set at protocol 2": lambda: b"c__builtin__\nset\n" + _batched(ints, b"]", b"e") + b"\x85R",
            "dict of int(text)": lambda: b"c__builtin__\nint\nq\x000" + _batched(  # int("2305843009213693951")
                [b"h\x00" + _unicode(b"%d" % (k * P)) + b"\x85R" for k in range(1, n + 1)], b"}", b"u", b"N")}
    return b"\x80\x04" + body[shape]() + b"."


FLOODS = ["dict of ints", "dict of tuples", "dict of (dtype, int)", "set", "frozenset", "set at protocol 2",
          "dict of int(text)"]


@pytest.mark.parametrize("shape", FLOODS)
def test_keys_chosen_to_collide_are_refused_before_the_container_is_built(shape, monkeypatch):
    """What the reader would build: every key of one hash, all unequal (checked on 100 of them),
    20,000 keys: 2 * 10**8 comparisons. The scan hashes each key once at most, compares none,
    and refuses (a batched container at the end of its first batch: 1000 keys hashed)."""
    small = MetadataUnpickler(io.BytesIO(_flood(shape, 100))).load()
    keys = list(small[0] if isinstance(small, tuple) else small)
    assert len(keys) == 100 and len({hash(k) for k in keys}) == 1
    hashed, count = [], pickle_keys.count
    monkeypatch.setattr(pickle_keys, "count",
                        lambda counts, cells, *a: hashed.append(len(cells)) or count(counts, cells, *a))
    with pytest.raises(pickle.UnpicklingError, match=f"more than {pickle_keys.BOUND} keys of one hash"):
        check_expansion(_flood(shape, 20_000))
    assert sum(hashed) <= (20_000 if shape in ("frozenset", "set at protocol 2") else 1000) < 20_000 * 19_999 // 2
    check_expansion(_flood(shape, pickle_keys.BOUND))  # up to the bound: the reader makes 2016 comparisons


def test_colliding_dcp_metadata_keys_are_refused_naming_the_file():
    """``MetadataIndex`` hashes as ``(fqn, offset)``: offsets of colliding numbers collide."""
    meta = _metadata(1, 1)
    meta.storage_data = {MetadataIndex("layers.0.weight", torch.Size([k * P, 0])): ("__0_0.distcp", 0, 64)
                         for k in range(1, 200)}
    with pytest.raises(UnsafeCheckpointError, match=r"x/\.metadata: .* more than 64 keys of one hash"):
        parse_dcp_metadata(pickle.dumps(meta), "x/.metadata")


def test_torch_load_refuses_colliding_keys_and_reads_many_distinct_ones():
    with pytest.raises(UnsafeCheckpointError, match="keys of one hash"):
        torch_load(io.BytesIO(_zip_with(_flood("dict of ints", 2000))), "flood.pt")
    state = {"ids": {i: i for i in range(20_000)}, "seen": set(range(20_000)),
             "pairs": {(i, -i): 0 for i in range(5000)}}
    buf = io.BytesIO()
    torch.save(state, buf)
    assert torch_load(io.BytesIO(buf.getvalue()), "ok.pt") == state


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_many_distinct_keys_and_a_few_colliding_ones_pass(protocol):
    """Distinct numbers, tuples, text and paths hash apart; -1 and -2 (both -2), and 1 and 1.0,
    are the collisions real data has; the pickler never writes a key twice."""
    values = [{i: None for i in range(100_000)}, set(range(20_000)), frozenset(range(20_000)),
              {(i, str(i)): 1.5 for i in range(5000)}, {-1: 0, -2: 0, 1: 1, 2.5: 2, (1, 2): 3, None: 4},
              {PosixPath(f"/ckpt/{i}"): i for i in range(1000)}]
    for value in values:
        check_expansion(pickle.dumps(value, protocol))


def test_equal_text_keys_count_too():
    """Text hashes differ per process, yet the scan hashes it in the process that reads (a fixed
    ``PYTHONHASHSEED`` makes it targetable): 65 equal keys, which the pickler never writes, are
    refused like 65 colliding ones."""
    data = b"\x80\x04}(" + b"\x8c\x01a\x94N" + b"h\x00N" * pickle_keys.BOUND + b"u."
    with pytest.raises(pickle.UnpicklingError, match="keys of one hash"):
        check_expansion(data)
