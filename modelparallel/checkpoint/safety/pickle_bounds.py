"""How much work a pickle may make its reader do, bounded before it is read.

An allow-list decides which callables a pickle may name, not how much it builds: the memo lets
a pickle refer to one object many times, so ``t1 = (t0, t0)``, ``t2 = (t1, t1)`` ... costs a few
bytes per level while the object's expanded size doubles. Hashing it (a dict key, a set member,
a frozen dataclass such as DCP's ``MetadataIndex``) or turning it into text walks every
expanded node: a 400-byte ``.metadata`` or non-tensor entry would keep every rank busy forever,
and no rank raises. ``check_expansion`` runs the pickle's opcodes without building anything,
keeping only each object's expanded size, and refuses a pickle whose objects together would
take more than a budget linear in its length. A pickle that writes each object out (or shares
only small ones, as DCP's metadata shares its sizes and dtypes) stays far below it.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import zipfile

_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip member's local header: signature, then (past fields not used) name and extra lengths."""
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}
_MUTATE = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}
"""Opcodes that add to the object below their arguments: that object is not walked again."""


def budget(nbytes: int) -> int:
    """Most expanded nodes a pickle of ``nbytes`` bytes may build and walk (a DCP ``.metadata``
    walks about 3 per byte, whatever the protocol)."""
    return 64 * nbytes + (1 << 20)


def check_expansion(data: bytes) -> None:
    """Refuse ``data`` (a pickle) if reading it would build or walk more than ``budget`` nodes,
    before anything is built (also a length field past the end of the data).

    Raises:
        pickle.UnpicklingError: saying what it asked for (the caller names the file).
    """
    limit = budget(len(data))
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    work = 0
    try:
        for op, arg, _ in pickletools.genops(data):
            code = op.name
            if code == "MARK":
                marks.append(len(stack))
            elif code in _MEMO_PUT or code == "MEMOIZE":
                memo[len(memo) if code == "MEMOIZE" else arg] = stack[-1]
            elif code in _MEMO_GET or code == "DUP":
                stack.append(memo[arg] if code != "DUP" else stack[-1])
            elif code == "POP_MARK":
                del stack[marks.pop():]
            elif code == "STOP":
                break
            else:
                before = op.stack_before
                if pickletools.stackslice in before:
                    start = marks.pop() - before.index(pickletools.markobject)
                else:
                    start = len(stack) - len(before)
                if start < 0:
                    raise IndexError("stack underflow")
                taken = stack[start:]
                del stack[start:]
                work += sum(taken) - (taken[0] if code in _MUTATE and taken else 0)
                if work > limit:
                    raise pickle.UnpicklingError(f"refused: it builds more than {limit} objects from {len(data)} "
                                                 "bytes (objects shared through its memo many times over)")
                if op.stack_after:
                    stack.append(1 + sum(taken))
    except (IndexError, KeyError, ValueError) as e:
        raise pickle.UnpicklingError(f"not a valid pickle ({type(e).__name__}: {e})") from None


def check_zip_pickles(source: io.BytesIO) -> None:
    """``check_expansion`` on every pickle of the ``torch.save`` file (a zip) in ``source``, read
    where it is (its position kept); a pickle stored compressed is refused (``torch.save`` never
    compresses, and reading one would inflate it first). Anything that is not a zip is left to
    the reader.

    Raises:
        pickle.UnpicklingError: naming the pickle (the caller names the file).
    """
    start = source.tell()
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, ValueError, OSError):
        source.seek(start)
        return
    try:
        for info in archive.infolist():
            if not info.filename.endswith(".pkl"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise pickle.UnpicklingError(f"refused: {info.filename} is stored compressed")
            check_expansion(_stored(source, info))
    finally:
        archive.close()
        source.seek(start)


def _stored(source: io.BytesIO, info: zipfile.ZipInfo) -> bytes:
    """The bytes of a member stored uncompressed, read through its local header (not
    ``ZipFile.read``, which also checks a CRC-32 that some writers leave out and torch never reads)."""
    source.seek(info.header_offset)
    head = source.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(head)[0] != b"PK\x03\x04":
        raise pickle.UnpicklingError(f"{info.filename}: its zip header is damaged")
    _, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    source.seek(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
    data = source.read(info.file_size)
    if len(data) != info.file_size:
        raise pickle.UnpicklingError(f"{info.filename}: ends before its {info.file_size} bytes")
    return data
