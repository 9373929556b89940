"""DCP ``.metadata`` as any supported Python and torch pickle it loads through the safe
unpickler (``safe_load.parse_dcp_metadata``), and nothing broader does.

Pythons differ in how they pickle enum members: some (3.11.2 among them) write
``getattr(EnumClass, "NAME")``, others ``EnumClass(value)``; protocols 2 to 5 differ in opcodes
and protocol 2 names ``__builtin__`` / ``copy_reg`` and pickles bytes through
``_codecs.encode``. A refusal here would make every checkpoint that Python saved unloadable. A
failure of the refusal tests means the allow-list lets a pickle reach a callable it should not.
One process, no ranks.
"""

from __future__ import annotations

import copyreg
import enum
import io
import pathlib
import pickle
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from modelparallel.checkpoint.safety.files import UnsafeCheckpointError
from modelparallel.checkpoint.safety.safe_load import parse_dcp_metadata


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    """The metadata of a real DCP save: tensors (their properties hold an enum), a bytes entry."""
    path = tmp_path_factory.mktemp("dcp")
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16), "step": 7,
             "name": "run", "blob": b"\x00\xff"}
    with pytest.warns(UserWarning):  # no process group: DCP says it saves as one process
        dcp.save(state, checkpoint_id=str(path))
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written just now by DCP itself
    metadata.planner_data = {"blob": b"\x00\xff", "names": {"a", "b"}}  # bytes: protocol 2 writes _codecs.encode
    return metadata


class _EnumByGetattr(pickle.Pickler):
    """Pickles enum members as ``getattr(EnumClass, "NAME")``, as Python 3.11.2 does."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _dumps(obj, protocol: int, pickler=pickle.Pickler) -> bytes:
    buf = io.BytesIO()
    pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("form", ["value", "getattr"])
def test_metadata_of_every_pickling_form_loads(metadata, protocol, form):
    data = _dumps(metadata, protocol, _EnumByGetattr if form == "getattr" else pickle.Pickler)
    assert (b"getattr" in data) == (form == "getattr")
    assert (b"_codecs" in data) == (protocol == 2)
    got = parse_dcp_metadata(data, "x/.metadata")
    assert got == metadata
    props = [md.properties for md in got.state_dict_metadata.values() if hasattr(md, "properties")]
    assert {p.dtype for p in props} == {torch.float32, torch.bfloat16}


class _Evil(pickle.Pickler):
    """Pickles the metadata with one entry replaced by ``getattr(owner, name)``."""

    def __init__(self, buf, owner, name, target):
        super().__init__(buf, protocol=4)
        self.owner, self.attr, self.target = owner, name, target
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table[types.ModuleType] = lambda m: (__import__, (m.__name__,))

    def reducer_override(self, obj):
        if obj is self.target:
            return getattr, (self.owner, self.attr)
        return NotImplemented


@pytest.mark.parametrize("owner,name,refused", [
    (__import__("os"), "system", "builtins.__import__"),
    (object, "__subclasses__", "getattr(object, '__subclasses__')"),
    (pathlib.PosixPath, "write_text", "getattr(PosixPath, 'write_text')"),
    (_MEM_FORMAT_ENCODING, "__class__", "getattr(_MEM_FORMAT_ENCODING, '__class__'): not a member"),
    (_MEM_FORMAT_ENCODING, "_missing_", "getattr(_MEM_FORMAT_ENCODING, '_missing_'): not a member"),
])
def test_getattr_of_anything_but_an_allowed_enum_member_is_refused(metadata, owner, name, refused):
    buf = io.BytesIO()
    _Evil(buf, owner, name, metadata.state_dict_metadata["w"]).dump(metadata)
    with pytest.raises(UnsafeCheckpointError, match=r"x/\.metadata: not a valid DCP metadata file: refused") as info:
        parse_dcp_metadata(buf.getvalue(), "x/.metadata")
    assert refused in str(info.value)


def test_a_crafted_global_is_refused_before_getattr():
    with pytest.raises(UnsafeCheckpointError, match="refused to load os.system"):
        parse_dcp_metadata(b"cbuiltins\ngetattr\n(cos\nsystem\nVx\ntR.", "x/.metadata")
    with pytest.raises(UnsafeCheckpointError, match=r"refused _codecs.encode\(\.\.\., 'rot13'\)"):
        parse_dcp_metadata(b"c_codecs\nencode\n(Vx\nVrot13\ntR.", "x/.metadata")
