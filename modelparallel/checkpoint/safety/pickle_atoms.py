"""The values of a pickle's atoms (numbers, text, bytes, constants) decoded from their opcode
arguments, and global names as Python 3's unpickler resolves them.

Kept apart from ``pickle_keys`` because decoding what one opcode pushes needs nothing of the
containers and calls the key count follows; ``pickle_bounds`` builds its opcode table from
``decode`` and ``safe_load`` resolves globals with ``py3_global``.
"""

from __future__ import annotations

import _compat_pickle
import struct

UNKNOWN = object()
"""The value of an object whose hash the scan does not know (never counted)."""


def _line(data, start, end):
    return data[start:end - 1].decode("ascii")


def _int_line(data, start, end):  # protocol 0 writes True and False as INT 01 and 00
    text = _line(data, start, end)
    return True if text == "01" else False if text == "00" else int(text.rstrip("L"))


def _unknown(data, start, end):
    return UNKNOWN


def _ascii(data, start, end):
    return data[start:end].decode("ascii")


_DECODE = {
    "INT": _int_line, "LONG": _int_line,
    "BININT2": lambda d, s, e: int.from_bytes(d[s:e], "little"),
    "BININT": lambda d, s, e: int.from_bytes(d[s:e], "little", signed=True),
    "LONG1": lambda d, s, e: int.from_bytes(d[s:e], "little", signed=True),
    "LONG4": lambda d, s, e: int.from_bytes(d[s:e], "little", signed=True),
    "FLOAT": lambda d, s, e: float(_line(d, s, e)), "BINFLOAT": lambda d, s, e: struct.unpack(">d", d[s:e])[0],
    "BINUNICODE": lambda d, s, e: str(d[s:e], "utf-8", "surrogatepass"),
    "SHORT_BINUNICODE": lambda d, s, e: str(d[s:e], "utf-8", "surrogatepass"),
    "BINUNICODE8": lambda d, s, e: str(d[s:e], "utf-8", "surrogatepass"),
    "UNICODE": lambda d, s, e: str(d[s:e - 1], "raw-unicode-escape"),
    "BINBYTES": lambda d, s, e: bytes(d[s:e]), "SHORT_BINBYTES": lambda d, s, e: bytes(d[s:e]),
    "BINBYTES8": lambda d, s, e: bytes(d[s:e]),
    "BINSTRING": _ascii, "SHORT_BINSTRING": _ascii,  # str or bytes as the reader decodes: equal hashes if ASCII
}
"""Opcode name -> the value of the atom it pushes, from its argument ``data[start:end]``."""


_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}


def decode(name: str):
    """How the scan gets the cell of an atom opcode: the cell of a constant (a list), one cell
    per value of its byte (a tuple: ``BININT1``), or ``fn(data, start, end)`` -> its value
    (``UNKNOWN`` if none is known), which raises ``DECODE_ERRORS`` for what the reader cannot
    read either. An atom's cell is never changed (never filled): one serves every use."""
    if name in _CONSTANTS:
        return [1, True, 1, _CONSTANTS[name], None]
    if name == "BININT1":
        return tuple([1, True, 1, i, None] for i in range(256))
    return _DECODE.get(name, _unknown)


DECODE_ERRORS = (ValueError, UnicodeError, struct.error)


def py3_global(module: str, name: str) -> tuple[str, str]:
    """``(module, name)`` of a global as Python 3's unpickler resolves it (Python 2 names mapped)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def global_name(module: str, name: str) -> str:
    """``module.name`` as the readers resolve it (``py3_global``)."""
    return ".".join(py3_global(module, name))
