"""Reading checkpoint files without running code from them.

A pickle can name any importable callable and call it while it is read, so a checkpoint that
is unpickled freely can run anything on every rank that loads it. A manifest's CRC32 does not
help: whoever crafts a file recomputes it. So every read of a checkpoint file goes through one
of two restricted readers:

* ``torch_load``: ``torch.load(weights_only=True)``: tensors, numbers, strings, ``None``,
  lists, tuples, dicts, ``OrderedDict``, sets and torch dtypes/sizes; nothing else.
* ``parse_dcp_metadata``: DCP's ``.metadata`` file through ``MetadataUnpickler``, which builds
  only DCP's own metadata classes, ``torch.Size``, dtypes, layouts, paths and plain containers,
  then checks what they say (``metadata_check``: field types, chunks tiling each tensor).

Both first bound the work a pickle may ask for (``pickle_bounds``: objects shared through the
memo, exponentially, would otherwise hang every rank).

Anything else is refused with ``UnsafeCheckpointError`` naming the file and what it tried to
load. What users save (``user_content``, ``smp.save``) is checked on the way in with
``check_loadable``, so a save never writes what a load would refuse.
"""

from __future__ import annotations

import collections
import enum
import errno
import io
import pickle
import struct
from pathlib import Path
from typing import Any

import torch

from .files import CorruptFileError, UnsafeCheckpointError
from .metadata_check import metadata_problems
from .pickle_bounds import check_expansion
from .pickle_files import check_zip_pickles
from .pickle_keys import py3_global

# class name -> module of every class DCP's metadata pickles (torch 2.x)
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by its name, nothing else
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "dict", "list", "tuple", "object", "int", "float", "str", "bool"},
    "copyreg": {"_reconstructor"},
}


def _enum_member(cls, name):
    """``getattr(cls, name)`` as the pickles of some Pythons (3.11.2 among them) rebuild an enum
    member: allowed only for an enum class of the allow-list and the name of one of its members
    (no method, no dunder, no other class), so it returns a member and nothing callable."""
    allowed = isinstance(cls, type) and issubclass(cls, enum.Enum) \
        and cls.__name__ in _DCP_CLASSES.get(cls.__module__, ())
    if not allowed:
        raise pickle.UnpicklingError(f"refused getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}): "
                                     "only an enum member of DCP's metadata may be looked up")
    if not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(f"refused getattr({cls.__name__}, {name!r}): not a member of that enum")
    return cls.__members__[name]


def _latin1_bytes(text, encoding):
    """``_codecs.encode(text, "latin1")``: how protocol 2 pickles ``bytes``; nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"refused _codecs.encode(..., {encoding!r}): only bytes pickled as latin-1 text")
    return text.encode("latin1")


def _bytes(*args):
    """``bytes()`` as protocol 2 pickles an empty ``bytes``; never ``bytes(n)``, which would make
    every rank allocate and zero ``n`` bytes named by a few bytes of the file."""
    if args:
        raise pickle.UnpicklingError("refused bytes(...) with arguments: only bytes() of an empty value")
    return b""


_REDUCERS = {("builtins", "getattr"): _enum_member, ("_codecs", "encode"): _latin1_bytes, ("builtins", "bytes"): _bytes}
"""Callables some picklers use for metadata values, each replaced by a function that accepts
only that use."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; refuses every global outside ``_DCP_CLASSES`` and torch dtypes.

    What any supported Python and torch write is accepted: protocols 2 to 5 (protocol 2 names
    ``__builtin__`` and ``copy_reg``, mapped as Python's own unpickler maps them, and pickles
    bytes through ``_codecs.encode``) and enum members pickled as ``getattr(EnumClass, "NAME")``.
    """

    def find_class(self, module: str, name: str):
        module, name = py3_global(module, name)
        if (module, name) in _REDUCERS:
            return _REDUCERS[module, name]
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (not part of DCP's metadata)")


def parse_dcp_metadata(data: bytes, name: str | Path):
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file (``name``), with no code run.

    Raises:
        UnsafeCheckpointError: naming the file and the refused class, or what in the metadata
            does not describe a checkpoint (``metadata_problems``).
    """
    try:
        check_expansion(data)
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, AttributeError, EOFError, TypeError, ValueError, IndexError,
            RecursionError, struct.error) as e:
        raise UnsafeCheckpointError(f"{name}: not a valid DCP metadata file: {e}") from e
    problems = metadata_problems(metadata)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UnsafeCheckpointError(f"{name}: not a valid DCP metadata file: {problems[0]}{more}")
    return metadata


_DAMAGED = (EOFError, RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            UnicodeDecodeError, RecursionError, struct.error)
"""What ``torch.load`` raises for an empty, truncated or damaged file (e.g. ``EOFError`` with no
message for an empty one, ``RuntimeError: PytorchStreamReader failed ...`` for a truncated zip)."""


def torch_load(source: str | Path | io.BytesIO, name: str | None = None, trusted: bool = False, **kwargs) -> Any:
    """``torch.load(source, weights_only=True)`` on CPU (``trusted``: ``weights_only=False``, which
    runs what the file names: only for files the user wrote himself); every error names the file.

    Raises:
        UnsafeCheckpointError: the file holds something other than tensors and plain data.
        CorruptFileError: empty, truncated or damaged.
    """
    name = name or str(source)
    try:
        if not trusted and isinstance(source, io.BytesIO):
            check_zip_pickles(source)
        elif not trusted:  # a path (also /proc/self/fd/N, memory-mapped after): its pickles read from it
            with open(source, "rb") as f:
                check_zip_pickles(f)
        return torch.load(source, map_location="cpu", weights_only=not trusted, **kwargs)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        if trusted:
            raise CorruptFileError(f"{name}: not a readable torch.save file ({first[0] if first else e!r})") from e
        why = next((line for line in first if "Unsupported" in line or "GLOBAL" in line), first[0] if first else "")
        raise UnsafeCheckpointError(f"{name}: refused to load (it holds more than tensors and plain data, "
                                    f"and loading never runs code from a checkpoint): {why.strip()}") from e
    except OSError as e:  # torch's zip reader: EINVAL for a truncated file, the errno of a failed read
        if e.errno == errno.EINVAL or e.errno is None:
            raise CorruptFileError(f"{name}: not a readable torch.save file (truncated or damaged: {e})") from e
        raise type(e)(e.errno, e.strerror, str(name)) from e
    except _DAMAGED as e:
        first = (str(e).strip().splitlines() or ["no data"])[0]
        raise CorruptFileError(f"{name}: not a readable torch.save file (empty, truncated or damaged: "
                               f"{type(e).__name__}: {first})") from e


def rebuild(obj: Any, name: str | Path) -> Any:
    """``plain.from_plain(obj)`` (values stored tagged rebuilt), an error naming the file.

    Raises:
        CorruptFileError: a tagged value that cannot be rebuilt (forged or damaged).
    """
    from ..format.plain import from_plain

    try:
        return from_plain(obj)
    except _DAMAGED as e:
        raise CorruptFileError(f"{name}: a stored value cannot be rebuilt ({type(e).__name__}: {e})") from e


def check_loadable(obj: Any, what: str, escape: str = "pass trust_user_content=True, which loads with full "
                   "pickle and so runs whatever the file names") -> bytes:
    """``obj`` serialized, after checking that ``torch_load`` reads it back (so a save never
    writes what a load would refuse). Returns the bytes to write. ``escape``: how the caller
    may store it anyway, for the message (empty: no way).

    Raises:
        TypeError: naming the first type a checkpoint may not contain.
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        bad = _first_foreign(obj)
        raise TypeError(f"{what} holds {bad}, which a checkpoint cannot store safely: loading it would "
                        "need to run code. Store tensors, numbers, strings, None, lists, tuples, dicts, "
                        f"sets{f' (or {escape})' if escape else ''}") from e
    return buf.getvalue()


_PLAIN = (torch.Tensor, int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)


def _first_foreign(obj: Any, path: str = "") -> str:
    """Where the first value that is not plain data sits, e.g. ``an object of type Foo at ['a'][0]``."""
    if isinstance(obj, _PLAIN):
        return "an unsupported value" + (f" at {path}" if path else "")
    if isinstance(obj, collections.defaultdict):
        return f"a collections.defaultdict at {path or 'the top level'}"
    if isinstance(obj, dict):
        for k, v in obj.items():
            found = _first_foreign(v, f"{path}[{k!r}]")
            if not found.startswith("an unsupported value"):
                return found
        return "an unsupported value"
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            found = _first_foreign(v, f"{path}[{i}]")
            if not found.startswith("an unsupported value"):
                return found
        return "an unsupported value"
    kind = type(obj)
    return f"an object of type {kind.__module__}.{kind.__qualname__} at {path or 'the top level'}"
