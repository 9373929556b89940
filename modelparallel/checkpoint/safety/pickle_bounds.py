"""How much work a pickle may make its reader do, bounded before it is read.

An allow-list decides which callables a pickle may name, not how much it builds: the memo lets
a pickle refer to one object many times, so ``t1 = (t0, t0)``, ``t2 = (t1, t1)`` ... costs a few
bytes per level while the object's expanded size doubles. Hashing it (a dict key, a set member,
a frozen dataclass such as DCP's ``MetadataIndex``), comparing it, turning it into text or
walking it as a nested value walks every expanded node: a 400-byte ``.metadata`` or non-tensor
entry would keep every rank busy forever, and no rank raises. ``check_expansion`` runs the
pickle's opcodes without building anything, keeping only each object's expanded size, and
refuses a pickle whose objects together would take more than a budget linear in its length. A
pickle that writes each object out (or shares only small ones, as DCP's metadata shares its
sizes and dtypes) stays far below it.

A list, dict, set or object is made empty and then filled (``APPENDS``, ``SETITEMS``, ``BUILD``):
its size is kept in one cell that its memo entry shares, so a later use counts what it holds.
Filling an object after the memo handed it out again is refused: a container would then hold
one that grows afterwards (a size no count made up front bounds), or itself (a cycle, which
no checkpoint of tensors and plain data has; Python's pickler writes nothing else that way).

A call (``REDUCE`` and the like) also pays for every byte of the strings it is given, and what
it returns counts as much: an allowed callable may make one object per character (``list(s)``,
``str`` of a list holding ``s`` many times). What no count bounds is refused outright: a memo
index past the data (the C unpickler allocates an array that long) and ``bytearray`` called on
anything but text (``bytearray(n)`` allocates ``n`` bytes).

Finding the pickles of a ``torch.save`` file (``check_zip_pickles``) is ``pickle_files``' part.
"""

from __future__ import annotations

import pickle
import pickletools

from ..paused_gc import paused_gc
from . import pickle_keys

_MUTATE = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}
"""Opcodes that add their arguments to the object below them (which stays on the stack)."""
_CALLS = {"REDUCE", "NEWOBJ", "NEWOBJ_EX", "INST", "OBJ", "BINPERSID"}
"""Opcodes that hand their arguments to a callable: it may walk every character of a string in
them (``list(s)``, ``str`` of a list holding it), so the call costs their weight."""


def budget(nbytes: int) -> int:
    """Most expanded nodes a pickle of ``nbytes`` bytes may build and walk (a DCP ``.metadata``
    walks about 3 per byte, whatever the protocol)."""
    return 64 * nbytes + (1 << 20)


_GENERIC, _MEMOIZE, _GET1, _GET, _PUT, _MARK, _DUP, _POP_MARK, _STOP, _ATOM, _TEXT, _GLOBAL = range(12)
_ACTIONS = {"MEMOIZE": _MEMOIZE, "BINGET": _GET1, "LONG_BINGET": _GET, "GET": _GET, "BINPUT": _PUT,
            "LONG_BINPUT": _PUT, "PUT": _PUT, "MARK": _MARK, "DUP": _DUP, "POP_MARK": _POP_MARK, "STOP": _STOP,
            "GLOBAL": _GLOBAL}
_TEXTS = {"bytes_or_str", "bytes", "str", "bytearray"}
"""What the atoms whose bytes only a call pays push (see ``check_expansion``)."""
_FIXED, _LINES, _SIZED = range(3)
_LENGTHS = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: -4,
            pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
"""Bytes of a length argument that precedes the data (negative: signed)."""


def _opcode_table() -> list:
    """Indexed by opcode byte (None: not an opcode): (action, argument layout, its size, items
    below a mark it pops (or -1: none), items popped otherwise, pushes one, adds to the object
    below its arguments (1) or calls (2), what ``pickle_keys`` follows of it, the decoder of an atom's value).
    From the standard library's descriptions of the opcodes."""
    table: list = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            layout = (_FIXED, 0)
        elif arg.n >= 0:
            layout = (_FIXED, arg.n)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            layout = (_LINES, 2 if op.name in ("GLOBAL", "INST") else 1)
        else:
            layout = (_SIZED, _LENGTHS[arg.n])
        before = op.stack_before
        below = before.index(pickletools.markobject) if pickletools.stackslice in before else -1
        action = _ACTIONS.get(op.name, _GENERIC)
        if action == _GENERIC and not before and op.stack_after and op.stack_after[0].name not in _FILLABLE:
            action = _TEXT if op.stack_after[0].name in _TEXTS else _ATOM
        table[ord(op.code)] = (action, *layout, below, len(before), bool(op.stack_after),
                               1 if op.name in _MUTATE else 2 if op.name in _CALLS else 0,
                               pickle_keys.KINDS.get(op.name), pickle_keys.decode(op.name))
    return table


_FILLABLE = {"list", "dict", "set"}
"""What an opcode that takes nothing may push and a later opcode fill (the rest: atoms)."""
_TABLE = tuple(_opcode_table())


@paused_gc()  # one small list per object made: a collection would walk them all, again and again
def check_expansion(data: bytes) -> int:
    """Refuse ``data`` (a pickle) if reading it would build or walk more than ``budget`` nodes,
    or put more than ``pickle_keys.BOUND`` keys of one hash in one container, before anything is
    built (also an unknown opcode, or an argument past the end of the data).

    The opcodes are followed as the unpickler reads them, on a stack of cells, one per object:
    [expanded size (its node count, a shared object counted every time it is used), handed out
    again by the memo, weight, value, contents]. The weight also counts the bytes of every string
    in it, which only a call pays (the pickler shares strings freely; hashing or storing one walks
    none of it); a long number counts its bytes in both (hashing one walks it). The value is the
    object where the scan knows it (numbers, text, tuples of them: see ``pickle_keys``), the
    contents what it holds (a list's cells, a dict's counts of keys per hash, a global's name). An
    opcode that takes objects off the stack costs their sizes (the container it only adds to
    excepted). Text arguments are not parsed (the unpickler refuses bad ones); memo indexes are.
    ``bytearray`` (``torch.load`` allows it) called on anything but text is refused:
    ``bytearray(n)`` allocates ``n`` bytes; the pickler only calls it on bytes.

    Returns:
        Where the pickle ends (past its ``STOP``): what follows is not read.

    Raises:
        pickle.UnpicklingError: saying what it asked for (the caller names the file).
    """
    data = bytes(data)
    FIXED, LINES, MEMOIZE, ATOM, TEXT, GET1, GET, DUP, GENERIC, PUT, MARK, POP_MARK, GLOBAL = (  # noqa: N806
        _FIXED, _LINES, _MEMOIZE, _ATOM, _TEXT, _GET1, _GET, _DUP, _GENERIC, _PUT, _MARK, _POP_MARK, _GLOBAL)
    UNKNOWN, DECODE_ERRORS, STANDS = pickle_keys.UNKNOWN, pickle_keys.DECODE_ERRORS, pickle_keys.STANDS  # noqa: N806
    limit, table, end, pos = budget(len(data)), _TABLE, len(data), 0
    stack: list[list] = []
    marks: list[int] = []
    memo: dict[int, list] = {}
    work = 0
    try:
        while True:
            action, layout, size, below, popped, pushes, mutate, kind, decode = table[data[pos]]
            arg = start = pos + 1
            if layout == FIXED:
                pos = arg + size
            elif layout == LINES:
                pos = data.index(b"\n", arg) + 1
                if size == 2:
                    pos = data.index(b"\n", pos) + 1
            else:
                width = -size if size < 0 else size
                length = int.from_bytes(data[arg:arg + width], "little", signed=size < 0)
                if length < 0 or arg + width + length > end:
                    raise ValueError(f"opcode {data[pos]:#04x} at byte {pos} asks for {length} bytes, "
                                     f"{end - arg - width} remain")
                start = arg + width
                pos = start + length
            if pos > end:
                raise ValueError(f"opcode {data[arg - 1]:#04x} at byte {arg - 1}: its argument runs past the end")
            if action == MEMOIZE:
                cell = memo[len(memo)] = stack[-1]
                if cell[3] is UNKNOWN and type(cell[4]) is not list:
                    cell[3] = (STANDS, id(cell))  # see pickle_keys.STANDS
            elif action == ATOM or action == TEXT:  # never filled: the reader refuses that too
                if type(decode) is list:
                    stack.append(decode)
                elif type(decode) is tuple:
                    stack.append(decode[data[arg]])
                else:
                    try:
                        value = decode(data, start, pos)
                    except DECODE_ERRORS:
                        value = UNKNOWN
                    weight = 1 if layout == FIXED else 1 + pos - arg
                    stack.append([1 if action == TEXT else weight, True, weight, value, None])
            elif action == GET1 or action == GET or action == DUP:
                cell = memo[data[arg] if action == GET1 else _index(data, arg, pos, layout)] \
                    if action != _DUP else stack[-1]
                cell[1] = True
                stack.append(cell)
            elif action == GENERIC:
                at = marks.pop() - below if below >= 0 else len(stack) - popped
                if at < 0:
                    raise IndexError("stack underflow")
                taken = stack[at:]
                del stack[at:]
                cost = weight = 0
                if mutate == 1:
                    cell = taken[0]
                    if cell[1]:
                        raise _refill(arg - 1)
                    for item in taken[1:]:
                        cost += item[0]
                        weight += item[2]
                    cell[0] += cost
                    cell[2] += weight
                    stack.append(cell)
                else:
                    for item in taken:
                        cost += item[0]
                        weight += item[2]
                    if mutate == 2:
                        callee = taken[0][4] if popped == 2 and below < 0 else None
                        if type(callee) is str and callee.endswith(".bytearray") \
                                and 1 < taken[1][0] >= taken[1][2]:  # neither () nor text in its arguments
                            raise pickle.UnpicklingError(f"refused: at byte {arg - 1} it calls bytearray() on no "
                                                         "string or bytes (bytearray(n) allocates n bytes)")
                        cost = weight  # what _codecs.encode returns is bytes: counted as a text atom
                        cell = [1, False, 2 + weight, UNKNOWN, None] if callee == "_codecs.encode" else \
                            [1 + weight, False, 1 + weight, UNKNOWN, None]
                        stack.append(cell)
                    elif pushes:
                        cell = [1 + cost, False, 1 + weight, UNKNOWN, None]
                        stack.append(cell)
                work += cost
                if kind is not None and work <= limit:  # what it hashes walks no more than was paid
                    if layout == LINES:  # INST: its class named on two lines
                        module, name = data[arg:pos - 1].decode("utf-8", "replace").split("\n")
                        taken.insert(0, [1, True, 1, UNKNOWN, pickle_keys.global_name(module, name)])
                    work += kind(taken, cell, arg - 1)
                if work > limit:
                    raise pickle.UnpicklingError(f"refused: it builds more than {limit} objects from {len(data)} "
                                                 "bytes (objects shared through its memo many times over)")
            elif action == PUT:
                index = _index(data, arg, pos, layout)
                if index >= end:  # Python's C unpickler sizes its memo array by the largest index
                    raise pickle.UnpicklingError(f"refused: at byte {arg - 1} a memo index of {index}, past "
                                                 f"the {end} bytes of the pickle")
                cell = memo[index] = stack[-1]
                if cell[3] is UNKNOWN and type(cell[4]) is not list:
                    cell[3] = (STANDS, id(cell))  # see pickle_keys.STANDS
            elif action == MARK:
                marks.append(len(stack))
            elif action == GLOBAL:
                module, name = data[arg:pos - 1].decode("utf-8", "replace").split("\n")
                name = pickle_keys.global_name(module, name)
                stack.append([1, True, 1, ("a global", name), name])
            elif action == POP_MARK:
                del stack[marks.pop():]
            else:
                return pos
    except (IndexError, KeyError, ValueError, TypeError) as e:
        if isinstance(e, (IndexError, TypeError)) and pos >= end:
            e = ValueError("the data ends before its STOP opcode")
        elif isinstance(e, TypeError):  # a byte that is no opcode (None in the table)
            e = ValueError(f"no opcode {data[pos]:#04x} at byte {pos}")
        raise pickle.UnpicklingError(f"not a valid pickle ({type(e).__name__}: {e})") from None


def _refill(at: int) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"refused: at byte {at} it adds to an object its memo already handed out (a "
                                  "container of itself, or one that grows after it was shared)")


def _index(data: bytes, arg: int, end: int, layout: int) -> int:
    """A memo opcode's index: binary (little-endian) or a decimal text line."""
    return int(data[arg:end - 1]) if layout == _LINES else int.from_bytes(data[arg:end], "little")
