"""The keys a pickle makes its reader hash, bounded before it is read (``pickle_bounds``' scan).

A dict or set finds a key by its hash; keys with equal full hashes but unequal values are
compared one by one, so the ``k``-th of them costs ``k`` comparisons and ``n`` of them
``n**2 / 2``. Integers ``i * (2**61 - 1)`` all hash to 0 (and floats, tuples of them, complex
numbers, frozensets of them follow): 20,000 such keys in a 300 KB ``.metadata`` cost its reader
2 s, 3 MB minutes, on every rank. So the scan keeps the value of every object whose hash it can
know and counts, per container, the keys of each hash: more than ``BOUND`` of one is refused.

``BOUND = 64``: unequal keys with equal full hashes do not happen by chance (64-bit hashes;
integers collide only when they differ by a multiple of 2**61 - 1, and -1 with -2), so a
checkpoint's containers hold one key per hash, two at most; 64 leaves that a wide margin while
the reader's worst case stays under 32 comparisons per key, each of which the scan also charges
(the key's expanded size per earlier key of its hash, on the budget of ``pickle_bounds``).
Equal keys count too: the pickler never writes a key twice.

Strings and bytes are counted like the rest: their hashes are randomized per process, but the
scan runs in the process that reads, so it hashes them as the reader will (a fixed
``PYTHONHASHSEED`` makes them targetable). Known, besides atoms and tuples of known values:
what the readers' allowed constructors make of known values (``int``, ``float``, ``str``,
``complex``, ``tuple``, ``frozenset``, ``torch.Size``, paths, latin-1 bytes; also through
``NEWOBJ`` and ``copyreg._reconstructor``) and DCP's ``MetadataIndex`` (``hash((fqn, offset))``,
from its ``BUILD`` state). A list handed to a call that hashes what it is given (``set``,
``frozenset``, ``dict``, ``OrderedDict``, ``Counter``: elements, or the first of each pair) is
counted at that call. An object the scan knows no value of
stands for itself (a global for its name, an object the memo keeps for its cell): one used in
many keys hashes alike in each, as in the reader. Left uncounted, as no key set can be aimed at
them: objects of unknown value made anew for each key (a tensor: a hash of its identity; an enum
member or a device: one of a few values).

The atoms' values and global names come from ``pickle_atoms`` (re-exported here).
"""

from __future__ import annotations

import operator
import pickle
from pathlib import PurePosixPath, PureWindowsPath

from .pickle_atoms import (  # noqa: F401 - part of this module's API
    DECODE_ERRORS, UNKNOWN, decode, global_name, py3_global)

_VALUE = operator.itemgetter(3)
BOUND = 64
_MI = "torch.distributed.checkpoint.metadata.MetadataIndex"
_MI_PENDING = "<a MetadataIndex before its BUILD>"
_FIELDS = frozenset({"fqn", "offset"})
"""The ``MetadataIndex`` fields its hash is made of: a dict filled with them keeps their cells."""


def _latin1(text, encoding="utf-8"):
    if encoding not in ("latin1", "latin-1"):
        raise ValueError(encoding)
    return text.encode("latin1")


_EVAL = {"builtins.int": int, "builtins.float": float, "builtins.str": str, "builtins.complex": complex,
         "builtins.bool": bool, "builtins.tuple": tuple, "builtins.frozenset": frozenset, "torch.Size": tuple,
         "_codecs.encode": _latin1, "pathlib.PosixPath": PurePosixPath, "pathlib.PurePosixPath": PurePosixPath,
         "pathlib.Path": PurePosixPath, "pathlib.WindowsPath": PureWindowsPath,
         "pathlib.PureWindowsPath": PureWindowsPath}
"""Constructors the readers allow whose result's hash follows from their arguments, evaluated on
known values (a value of equal hash: ``torch.Size`` hashes as its tuple, a path as its text)."""
_DECIMAL = {"builtins.int", "builtins.str", "builtins.float", "builtins.complex"}
_DECIMAL_BYTES = 64
_LONG_DECIMAL = ("a number or text converted from more than 64 bytes",)
"""The value of every ``_DECIMAL`` conversion of more than ``_DECIMAL_BYTES`` bytes: the scan
does not make them (``str`` of a number and ``int`` of text take time quadratic in the digits,
and the call pays only linearly), so they share one hash: a container holds ``BOUND`` of them at most
(no checkpoint has even one such key)."""
_HASHES = {"builtins.set": False, "builtins.frozenset": False, "collections.Counter": False,
           "builtins.dict": True, "collections.OrderedDict": True, "collections.defaultdict": True}
"""Callables that hash what they are given: each element (False) or the first of each pair (True)."""


def count(counts: dict, keys, at: int, what: str) -> int:
    """Adds ``keys`` (cells) to a container's ``counts`` (hash -> keys); returns the comparisons
    the reader makes (each key's expanded size per earlier key of its hash).

    Raises:
        pickle.UnpicklingError: more than ``BOUND`` keys of one hash.
    """
    work = 0
    for cell in keys:
        value = cell[3]
        if value is UNKNOWN:
            continue
        try:
            h = hash(value)
        except TypeError:  # unhashable: the reader fails
            continue
        seen = counts.get(h, 0)
        counts[h] = seen + 1
        if seen:
            if seen >= BOUND:
                raise pickle.UnpicklingError(
                    f"refused: at byte {at} {what} gets more than {BOUND} keys of one hash ({h}): keys chosen "
                    "to collide in Python's hash make its reader compare each new one with all before it")
            work += seen * cell[0]
    return work


def _contents(cell: list, kind: type):
    if type(cell[4]) is not kind:
        cell[4] = kind()
    return cell[4]


def _pairs(counts: dict, cells: list, at: int) -> int:
    """``count`` of the keys of ``cells`` (key, value, key, value...); a small dict (an object's
    state) also keeps the cells of the values of ``_FIELDS``, under their names."""
    if len(cells) <= 8:
        for i in range(0, len(cells) - 1, 2):
            if type(cells[i][3]) is str and cells[i][3] in _FIELDS:
                counts[cells[i][3]] = cells[i + 1]
    return count(counts, cells[::2], at, "a dict")


def _setitems(taken: list, cell: list, at: int) -> int:
    return _pairs(_contents(cell, dict), taken[1:], at)


def _additems(taken: list, cell: list, at: int) -> int:
    return count(_contents(cell, dict), taken[1:], at, "a set")


def _append(taken: list, cell: list, at: int) -> int:
    if cell[4] is None:  # a list made by a call
        cell[4] = []
    if type(cell[4]) is list:
        cell[4] += taken[1:]
    return 0


def _build(taken: list, cell: list, at: int) -> int:
    state = taken[-1][4]
    if cell[4] is _MI_PENDING and type(state) is dict and "fqn" in state:
        value = (state["fqn"][3], state["offset"][3] if "offset" in state else None)
        cell[3] = UNKNOWN if UNKNOWN in value else value
    return 0


def _tuple(taken: list, cell: list, at: int) -> int:
    cell[4] = taken
    values = tuple(map(_VALUE, taken))
    cell[3] = UNKNOWN if UNKNOWN in values else values
    return 0


def _list(taken: list, cell: list, at: int) -> int:
    cell[4] = taken
    return 0


def _dict(taken: list, cell: list, at: int) -> int:
    return _pairs(_contents(cell, dict), taken, at)


def _frozenset(taken: list, cell: list, at: int) -> int:
    work = count({}, taken, at, "a frozenset")
    values = _values(taken)
    cell[3] = UNKNOWN if values is UNKNOWN else frozenset(values)
    return work


def _stack_global(taken: list, cell: list, at: int) -> int:
    if len(taken) == 2 and type(taken[0][3]) is str and type(taken[1][3]) is str:
        cell[4] = global_name(taken[0][3], taken[1][3])
        cell[3] = ("a global", cell[4])
    return 0


STANDS = "an object"
"""``(STANDS, id(cell))``: the value the scan gives an object the memo keeps whose value it does
not know (a list excepted: it keeps its elements for calls), so that keys holding the same object
(``(t, i)`` for one tensor ``t``) hash alike, as they do in the reader, and their other parts
are counted."""


def _reduce(taken: list, cell: list, at: int) -> int:
    """``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``: the callable, then its arguments' tuple."""
    if type(taken[0][4]) is not str or taken[0][4] not in _MODELLED or len(taken) < 2:
        return 0
    args = taken[1]
    if taken[0][4] == "torch.Size" and type(args[4]) is list and len(args[4]) == 1 \
            and type(args[4][0][3]) is tuple:  # what DCP's metadata makes most: a size of a tuple
        cell[3] = args[4][0][3]
        return 0
    return _call(taken[0][4], args[4] if type(args[4]) is list else () if args[3] == () else None, cell, at)


def _obj(taken: list, cell: list, at: int) -> int:
    """``OBJ`` and ``INST`` (given its class as a first cell): the callable, then each argument."""
    return _call(taken[0][4], tuple(taken[1:]), cell, at)


KINDS = {"TUPLE": _tuple, "TUPLE1": _tuple, "TUPLE2": _tuple, "TUPLE3": _tuple, "LIST": _list,
         "EMPTY_LIST": _list, "DICT": _dict, "FROZENSET": _frozenset, "STACK_GLOBAL": _stack_global,
         "REDUCE": _reduce, "NEWOBJ": _reduce, "NEWOBJ_EX": _reduce, "OBJ": _obj, "INST": _obj,
         "APPEND": _append, "APPENDS": _append, "SETITEM": _setitems, "SETITEMS": _setitems,
         "ADDITEMS": _additems, "BUILD": _build}
"""What the scan calls, after paying for an opcode, with the cells it took and the one it pushed
or filled and the opcode's position; each returns the comparisons the reader makes."""


def _values(cells):
    values = tuple(map(_VALUE, cells))
    return UNKNOWN if UNKNOWN in values else values


def _argument(cell):
    """A cell's value as a call is given it: a list's known elements as a list."""
    if cell[3] is UNKNOWN and type(cell[4]) is list:
        values = [c[3] for c in cell[4]]
        return UNKNOWN if UNKNOWN in values else values
    return cell[3]


def _call(name, args, cell: list, at: int) -> int:
    """The result of calling ``name`` (a global's name, or else nothing known) on the cells ``args``."""
    if type(name) is not str or args is None:
        return 0
    if name == "copyreg._reconstructor" and len(args) == 3:  # base.__new__(cls, state), base.__init__
        if args[0][4] == _MI:
            cell[4] = _MI_PENDING
            return 0
        name, args = args[1][4], args[2:]
        if type(name) is not str:
            return 0
    if name == _MI:
        cell[4] = _MI_PENDING
        return 0
    work, pairs = 0, _HASHES.get(name)
    if pairs is not None:
        for arg in args:
            if type(arg[4]) is list:  # a list's or a tuple's cells
                keys = [c[4][0] for c in arg[4] if type(c[4]) is list and c[4]] if pairs else arg[4]
                work += count({}, keys, at, f"a call of {name}")
    fn = _EVAL.get(name)
    if fn is not None:
        values = tuple([_argument(c) for c in args])
        if name in _DECIMAL and sum(c[2] for c in args) > _DECIMAL_BYTES:
            cell[3] = _LONG_DECIMAL
        elif UNKNOWN not in values:
            try:
                cell[3] = fn(*values)
            except Exception:  # noqa: BLE001 - what the reader refuses, or a value never hashed
                cell[3] = UNKNOWN
    return work


_MODELLED = {*_EVAL, *_HASHES, _MI, "copyreg._reconstructor"}
"""The callables ``_call`` knows something of (the rest make what the scan does not follow)."""
